"""--strategy ddp: a full replica per process, gradients all-reduced by DistributedDataParallel; checkpoints are one
full .pt written by global rank 0."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from .. import loop, snapshot, state
from ..config import Config
from ..data import Split
from ..dist import DistContext
from ..state import TrainState
from ..strategy import Strategy


class DDPStrategy(Strategy):
    sharded_checkpoints = False

    def build(self, cfg: Config, ctx: DistContext) -> TrainState:
        return state.build(cfg, ctx)

    def wrap(self, cfg: Config, ctx: DistContext, st: TrainState) -> None:
        state.wrap(cfg, ctx, st)

    def restore(self, cfg: Config, ctx: DistContext, st: TrainState) -> int:
        return snapshot.restore(cfg, ctx, st)

    def train_step(self, st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str, micro: int,
                   forward: Callable[[], AbstractContextManager[None]]) -> torch.Tensor:
        return loop.train_step(st, x, y, lr, precision, micro, forward)

    def evaluate(self, st: TrainState, test: Split, ctx: DistContext, precision: str, batch: int) -> float:
        return loop.evaluate(st.model, test, ctx, precision, batch)
