"""The one mixed-precision path: autocast with a dtype, and a gradient scaler enabled only for fp16.

The decision is a pure function of the precision, so it is unit-tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import defaults

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPlan:
    autocast_dtype: torch.dtype
    autocast_enabled: bool
    scaler_enabled: bool


def precision_plan(precision: str) -> PrecisionPlan:
    """fp32: no autocast, no scaler. bf16: autocast to bfloat16 (same exponent range as fp32, so gradients
    do not underflow: no scaler). fp16: autocast to float16 plus loss scaling (on CUDA, and on the CPU, where torch
    has fp16 autocast and a CPU GradScaler). The device type only selects which implementation runs."""
    return PrecisionPlan(_DTYPES[precision], precision != "fp32", precision == "fp16")


def autocast(device: torch.device, precision: str) -> torch.autocast:
    plan = precision_plan(precision)
    return torch.autocast(device_type=device.type, dtype=plan.autocast_dtype, enabled=plan.autocast_enabled)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """torch.amp.GradScaler(device type) for fp16; a disabled pass-through otherwise (step() just steps)."""
    return torch.amp.GradScaler(device.type, enabled=precision_plan(precision).scaler_enabled)


def bf16_fast(device: torch.device) -> bool:
    """A GPU with bf16 tensor cores (compute capability 8.0, Ampere, or later); elsewhere bf16 is emulated."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def resolve(given: str, device: torch.device) -> str:
    """--precision as this device runs it: "auto" made concrete by trainer/defaults.py's rule."""
    return defaults.resolve_precision(given, device.type, bf16_fast(device))[0]
