"""What training carries from step to step: model (plain, DDP-wrapped or FSDP-sharded), optimizer, scaler,
position; built here on this rank's device (device.py, models.py, optim.py, parallel.py). snapshot.py saves it into
a checkpoint and restores it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import device, models, optim, parallel
from .config import Config
from .dist import DistContext


@dataclass
class Position:
    """Where training stands: completed epochs, samples consumed in the current epoch, global steps."""

    epoch: int = 0
    sample: int = 0
    step: int = 0


@dataclass
class TrainState:
    model: nn.Module  # unwrapped (or FSDP-sharded): what checkpoints hold and evaluation runs
    ddp: nn.Module  # what the training step calls (the model itself for one process and for FSDP)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    pos: Position


def build(cfg: Config, ctx: DistContext, sharded: bool = False) -> TrainState:
    """Model, optimizer and scaler on this rank's device; same initial weights on every rank (seeded).
    `sharded` (the FSDP strategy): the model is sharded here, before the optimizer takes its (sharded) parameters;
    one process keeps it whole."""
    model = device.place(models.for_run(cfg), ctx.device)
    if sharded and ctx.distributed:
        model = parallel.shard(cfg, ctx, model)
    optimizer = optim.build(cfg, model.parameters(), sharded)  # after the move: fused optimizers need CUDA parameters
    return TrainState(model, model, optimizer, parallel.grad_scaler(cfg, ctx.device, sharded), Position())


def wrap(cfg: Config, ctx: DistContext, st: TrainState, sharded: bool = False) -> None:
    """Wrap in DDP after a restore (DDP's constructor broadcasts rank 0's weights); a `sharded` model (built so)
    is stepped as it is. --compile compiles what the step calls, never st.model: checkpoints and evaluation keep
    the plain module (its own keys, no `_orig_mod.`; evaluation's eval mode and shapes would only add
    compilations)."""
    st.ddp = st.model if sharded else parallel.wrap_ddp(cfg, ctx, st.model)
    if cfg.compile != "off":
        st.ddp = torch.compile(st.ddp, backend=cfg.compile)  # type: ignore[assignment]
