"""How busy the hardware is: model FLOPs per image (counted once, by torch) and the device's peak, for MFU.

MFU = model FLOPs per second (images/s x FLOPs per image, forward + backward) over the peak of the devices that
produce them, for the run's precision. On a CPU, or a GPU missing from the table, MFU is not applicable (None).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from . import models

log = logging.getLogger(__name__)

# Dense tensor-core peaks in TFLOPS (the datasheets give "with sparsity" figures twice these), matched as
# substrings of torch.cuda.get_device_name(), most specific first: (name, bf16/fp16, tf32). NVIDIA H100 Tensor
# Core GPU datasheet (BF16 SXM 1,979 / PCIe 1,513 / NVL 1,671, TF32 989 / 756 / 835, all with sparsity); NVIDIA
# H200 datasheet (as H100 SXM and NVL); NVIDIA A100 datasheet (BF16 312, TF32 156 dense, SXM and PCIe alike);
# NVIDIA L40S datasheet (BF16 362.05, TF32 183 dense). fp32 runs use the TF32 peak: PyTorch lets cuDNN's
# convolutions use TF32 by default (torch.backends.cudnn.allow_tf32).
PEAK_TFLOPS = (("H200 NVL", 835.5, 417.5), ("H200", 989.4, 494.7), ("H100 NVL", 835.5, 417.5),
               ("H100 PCIe", 756.5, 378.0), ("H100", 989.4, 494.7), ("A100", 312.0, 156.0),
               ("L40S", 362.05, 183.0))


def peak_tflops(name: str, precision: str = "bf16") -> float | None:
    """The device's dense peak for `precision` (bf16 and fp16 alike; fp32 as TF32), None when not in the table."""
    for key, half, tf32 in PEAK_TFLOPS:
        if key in name:
            return tf32 if precision == "fp32" else half
    return None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """FLOP/s of one device of this kind; None on a CPU (MFU is not applicable there)."""
    if device.type != "cuda":
        return None
    tflops = peak_tflops(torch.cuda.get_device_name(device), precision)
    return tflops * 1e12 if tflops else None


def flops_per_image(model_name: str) -> float:
    """Forward and backward of the model on two CIFAR-size images, counted by torch's FlopCounterMode (matmuls
    and convolutions), per image. On the meta device: shapes only, nothing computed, no state of the run's
    model touched (a training-mode forward would move its BatchNorm statistics)."""
    with torch.device("meta"):
        model = models.build(model_name)
        x, y = torch.empty(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / 2


@dataclass(frozen=True)
class Speed:
    """The job's FLOPs per image and its devices' summed peak (None: MFU not applicable)."""

    flops_per_image: float
    peak_flops: float | None

    def mfu(self, images_per_s: float) -> float | None:
        return images_per_s * self.flops_per_image / self.peak_flops if self.peak_flops else None


def measure(model_name: str, device: torch.device, precision: str, world_size: int) -> Speed | None:
    """Once at start, by global rank 0 (cheap: no computation). None, after a warning, for a model the meta
    device cannot run (an operator without a meta kernel): MFU is then left out, training goes on."""
    peak = device_peak_flops(device, precision)
    try:
        flops = flops_per_image(model_name)
    except (RuntimeError, NotImplementedError) as e:
        log.warning("model FLOPs not counted (%s): no MFU in this run", str(e).splitlines()[0] if str(e) else e)
        return None
    speed = Speed(flops, peak * world_size if peak else None)
    log.info("model FLOPs per image (forward + backward): %.4f GFLOP; MFU %s", speed.flops_per_image / 1e9,
             f"against {peak / 1e12:g} TFLOPS per device ({precision})" if peak else "n/a on this device")
    return speed


def mfu_text(mfu: float | None) -> str:
    return f"{mfu:.1%}" if mfu is not None else "n/a"
