"""What runs beside the training steps: when the ranks agree (the stop, save and evaluation flags), the SIGTERM flag,
and the clocks, heartbeat and background writer a rank carries through the loop (trainer/loop.py)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from types import FrameType

import torch.distributed as tdist

from . import checkpoint, metrics
from .dcp_checkpoint import PendingShards
from .defaults import RunSettings
from .dist import DistContext
from .ranktime import RankTimer
from .strategy import Strategy

# When the ranks agree on the stop, save and evaluation flags (and the loss's finiteness). The agreement is an
# all_reduce whose result the host reads: on a GPU that waits for every queued kernel, so doing it each fast step
# would drain the queue each step. A SIGTERM must be agreed soon though: torchrun SIGKILLs its workers 30 s after
# its SIGTERM, and the stop's checkpoint must be written before that. So the interval follows the step time: at
# most AGREE_EVERY steps, and no more steps than fit in AGREE_WITHIN_S at the slowest rank's pace (one step, if a
# step is longer). A 6 ms GPU step agrees every 8 steps (1/8 of a drain per step, as before); a 4 s step agrees
# every step (the drain costs nothing against it). With a fixed 8 such a job waited 32 s and lost its checkpoint.
AGREE_EVERY = 8
AGREE_WITHIN_S = 2.0


def agreement_interval(slowest_step_s: float) -> int:
    """Steps to the next agreement: the largest of 8, 4, 2, 1 whose steps at `slowest_step_s` (the slowest rank's
    seconds per step, agreed) fit in AGREE_WITHIN_S; 1 while no step is measured (0). Divisors of AGREE_EVERY, and
    agreements fall on their multiples, so every multiple of AGREE_EVERY is an agreement (the rank timings' windows
    end there, as before). PURE."""
    every = AGREE_EVERY
    while every > 1 and (slowest_step_s <= 0 or every * slowest_step_s > AGREE_WITHIN_S):
        every //= 2
    return every


@dataclass
class Cadence:
    """When the next agreement is: at the steps that are multiples of `every`, the same on every rank since it is
    decided from agreed figures only (a rank agreeing alone would meet its peers in another collective). Each
    agreement carries this rank's seconds per step over its previous window and sets `every` from the slowest
    rank's. The figure lags one window because on a GPU only a window closed by an agreement's read (which waits
    for every queued kernel) is the steps' real time; the host alone runs ahead of the device."""

    every: int = 1
    step_s: float = 0.0  # this rank's last complete window, sent at the next agreement (0: none yet)
    start: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    windows: int = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def restart(self, step: int) -> None:
        """After a pause that is not steps (a checkpoint, an epoch's end and evaluation): not in the window."""
        self.start, self.start_step = time.perf_counter(), step

    def agreed(self, step: int, slowest_step_s: float) -> None:
        """After the agreement at `step`: close this rank's window (not the process's first, whose step pays
        for start-up: allocation, a GPU's kernel selection) and take the agreed interval."""
        now = time.perf_counter()
        if self.windows > 0 and step > self.start_step:
            self.step_s = (now - self.start) / (step - self.start_step)
        self.windows += 1
        self.restart(step)
        self.every = agreement_interval(slowest_step_s)


class StopRequest:
    """SIGTERM sets a flag; the loop finishes its step, agrees with the other ranks, saves and exits 143."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # only a flag: no I/O or locks inside a signal handler


@dataclass
class LoopState:
    """The loop's state beside the model's (TrainState): the resolved settings, the heartbeat, the clocks of
    time-based checkpoints and evaluations, the background checkpoint writer, the agreement cadence (`pace` where a
    function takes it: it sets the loop's pace)."""

    heartbeat: metrics.Heartbeat
    settings: RunSettings
    strategy: Strategy  # how the model is spread: its step, evaluation and checkpoint format (trainer/strategies/)
    micro: int = 0  # micro-batch size for gradient accumulation (0: none)
    last_save: float = field(default_factory=lambda: time.monotonic())
    last_eval: float = field(default_factory=lambda: time.monotonic())
    writer: checkpoint.BackgroundWriter = field(default_factory=checkpoint.BackgroundWriter)  # DDP's
    ckpt_group: tdist.ProcessGroup | None = None  # sharded background saves (dist.checkpoint_group)
    shards: PendingShards | None = None  # a sharded save in flight (the same on every rank)
    timer: RankTimer | None = None  # this rank's step timings (None: not timed)
    steps: metrics.StepLog | None = None  # global rank 0's step records and TensorBoard (None on the others)
    cadence: Cadence = field(default_factory=Cadence)  # when the ranks next agree

    def restart_clocks(self, step: int) -> None:
        """After a pause that is not steps (a checkpoint, an epoch's end): the step clocks start again."""
        self.cadence.restart(step)
        if self.timer:
            self.timer.restart()
        if self.steps:
            self.steps.restart(step)

    def save_due(self, ctx: DistContext) -> bool:
        """Rank 0's clock decides (the others agree through the step's flag all_reduce)."""
        return ctx.is_main and _elapsed(self.last_save, self.settings.ckpt_every_s)

    def eval_due(self, ctx: DistContext) -> bool:
        """Rank 0's clock, agreed like save_due; acted on at an epoch's end only."""
        return ctx.is_main and _elapsed(self.last_eval, self.settings.eval_every_s)


def _elapsed(since: float, every_s: float) -> bool:
    return every_s > 0 and time.monotonic() - since >= every_s
