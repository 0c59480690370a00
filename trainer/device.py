"""Where a rank runs: refuse what its device cannot run (before anything is loaded), and put the model there in
the memory layout that device is fast with."""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import optim
from .config import Config, cuda_only
from .dist import DistContext
from .errors import DeviceError

log = logging.getLogger(__name__)


def check_device(cfg: Config, ctx: DistContext) -> None:
    """Refuse combinations the device cannot run, before anything is loaded."""
    cuda = ctx.device.type == "cuda"
    needs_cuda = cuda_only(cfg)
    if needs_cuda and not cuda:
        option, instead = needs_cuda[0]
        raise DeviceError(f"{option} needs a CUDA device; {instead}")
    if cfg.optimizer == "apex-fused-sgd":
        optim.apex_fused_sgd()  # not importable: say so now, before the data is read
    if cfg.precision == "bf16" and cuda and torch.cuda.get_device_capability(ctx.device)[0] < 8:
        log.warning("--precision bf16 on %s (compute capability < 8.0) is emulated and slow; "
                    "--precision fp16 is the fast choice on this GPU", ctx.device)


def memory_format(device: torch.device) -> torch.memory_format:
    """channels_last on CUDA (cuDNN's fast NHWC convolutions, tensor cores under autocast); NCHW elsewhere."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def place(model: nn.Module, device: torch.device) -> nn.Module:
    model = model.to(device, memory_format=memory_format(device))  # type: ignore[call-overload]  # not in its stubs
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed 32x32 shapes: let cuDNN pick its fastest kernels
    return model
