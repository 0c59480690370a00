"""The optimizer: SGD with Nesterov momentum (the fused kernel under DDP, foreach under FSDP), or NVIDIA apex's
FusedSGD."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import Config
from .errors import ConfigError


def apex_fused_sgd() -> type[torch.optim.Optimizer]:
    """NVIDIA apex's FusedSGD; a ConfigError saying what to do where apex is not importable."""
    try:
        from apex.optimizers import FusedSGD  # NVIDIA apex, built from source; never the PyPI "apex"
    except ImportError as e:
        raise ConfigError(
            "--optimizer apex-fused-sgd needs NVIDIA apex (github.com/NVIDIA/apex, built with its CUDA "
            "extensions); it is not importable here: use --optimizer sgd"
        ) from e
    return FusedSGD


def build(cfg: Config, params: Any, sharded: bool = False) -> torch.optim.Optimizer:
    """--optimizer over these parameters (on their device already: fused kernels need CUDA parameters).
    `sharded`: they are (or, on one process, stand for) FSDP's DTensors (the FSDP strategy says so)."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                              "nesterov": cfg.momentum > 0}
    if cfg.optimizer == "sgd" and sharded:
        # FSDP's parameters are DTensors, and DTensor has no sharding rule for the fused SGD kernel
        # (`aten._fused_sgd_.default does not have a sharding strategy registered`; its pointwise list has only
        # the fused Adam and AdamW). The foreach kernels are lists of pointwise ops, which it shards.
        return torch.optim.SGD(params, **kwargs, foreach=True)
    if cfg.optimizer == "sgd":
        return _fused_sgd(list(params), kwargs)
    try:
        return apex_fused_sgd()(params, **kwargs)
    except RuntimeError as e:  # apex imports without its CUDA extensions and fails only here
        raise ConfigError(f"--optimizer apex-fused-sgd: {e}; rebuild apex with --cuda_ext or use --optimizer sgd") from e


def _fused_sgd(params: list[nn.Parameter], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """DDP's SGD, in every precision: one kernel launch per step for all parameters (on a GPU the per-parameter
    launches of plain SGD cost more than the math for a ResNet), and under fp16 the kernel applies the loss scale
    and skips an overflowed step itself (`_step_supports_amp_scaling`); with any other SGD, GradScaler.step reads
    found_inf with .item(), a host sync every step. Its first step makes the momentum buffers with torch.empty_like and fills them in the
    kernel, which returns at once on an overflow (the usual first fp16 step, at a scale of 2^16): the next step
    would read uninitialised memory. Zeroed buffers from the start give the first step's math exactly
    (0.9 * 0 + g = g) and nothing to read uninitialised."""
    optimizer = torch.optim.SGD(params, **kwargs, fused=True)
    if kwargs["momentum"] > 0:
        for p in params:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer
