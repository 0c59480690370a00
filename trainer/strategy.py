"""How a run spreads its model over the processes, behind one interface: build, wrap, step, evaluate, save and
restore. DDP, FSDP and pipeline parallelism each implement it in a module of trainer/strategies/ (chosen once from
the config by strategies.for_config); the loop, the entry point and the self-test call the object, never test the
strategy's name. A new way to parallelise is one new module there.

The DDP and FSDP implementations call the functions that existed before this seam (state.build, loop.train_step,
loop.evaluate, snapshot.restore, parallel.wrap_ddp/shard), FSDP with their `sharded` argument: no module outside
trainer/strategies/ tests the strategy's name. Pipelining brings its own (trainer/pipeline.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import ClassVar

import torch

from .config import Config
from .data import Split
from .dist import DistContext
from .state import TrainState


class Strategy(ABC):
    """One run's way of spreading the model; built once per process from the config."""

    sharded_checkpoints: ClassVar[bool] = False
    """True: every rank writes its own part into a DCP folder (dcp_checkpoint.py), keyed by the full model's
    parameter names. False: global rank 0 writes one full .pt (checkpoint.py)."""

    @abstractmethod
    def build(self, cfg: Config, ctx: DistContext) -> TrainState:
        """Model (this process's part of it), optimizer and scaler on this rank's device, same seed everywhere."""

    @abstractmethod
    def wrap(self, cfg: Config, ctx: DistContext, st: TrainState) -> None:
        """After a restore: what the training step calls (DDP's wrapper broadcasts rank 0's weights)."""

    @abstractmethod
    def restore(self, cfg: Config, ctx: DistContext, st: TrainState) -> int:
        """Load the newest valid checkpoint into `st` (collective); the global batch it was trained with."""

    @abstractmethod
    def train_step(self, st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str, micro: int,
                   forward: Callable[[], AbstractContextManager[None]]) -> torch.Tensor:
        """One optimizer step on this process's batch; the batch's mean loss, on every rank."""

    @abstractmethod
    def evaluate(self, st: TrainState, test: Split, ctx: DistContext, precision: str, batch: int) -> float:
        """Test accuracy over the whole test set, the same on every rank (collective)."""

    def data_share(self, ctx: DistContext) -> tuple[int, int]:
        """(which share of each global batch this process reads, how many shares): one per process, unless
        several processes work on the same images (the stages of one pipeline)."""
        return ctx.rank, ctx.world_size

    def check_batch(self, ctx: DistContext, per_process: int) -> None:
        """Refuse (ConfigError) a batch of `per_process` images per process that this strategy cannot split; DDP
        and FSDP split any (gradient accumulation covers --keep-global-batch)."""
        return None

    def rank_stages(self, ctx: DistContext) -> tuple[int, ...] | None:
        """Each global rank's pipeline stage, for the heartbeat's per-rank view (None: not pipelined)."""
        return None

    def describe(self) -> str:
        """What the start-up log says about the layout (empty: nothing beyond the strategy's name)."""
        return ""
