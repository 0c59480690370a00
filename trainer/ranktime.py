"""Every rank times its own steps, with no synchronisation of its own; the figures ride on the agreement.

Per step, each rank measures (docs/DESIGN.md §2):
- data wait: the host's time in the loader's next() (perf_counter);
- forward: on a CPU perf_counter around the model's forward; on a GPU two CUDA events around it, read only after
  the next agreement, whose host read has waited for every kernel anyway (no synchronisation added);
- step: the wall clock of a window (AGREE_EVERY steps, or an epoch's rest) over its steps (a checkpoint's pause
  left out); a window ends at an agreement (trainer/pace.py: they may come more often, for slow steps).
Under DDP the forward holds no collective (no buffer broadcast), so data wait + forward is the rank's own work:
a throttled node or a slow data path makes it longer there and nowhere else. The backward cannot be told apart
from communication: DDP all-reduces gradient buckets while the backward still runs (gloo in a thread, NCCL on a
stream) and waits for them at its end, so a fast rank's backward absorbs its wait for the slowest one, and every
rank's step wall clock is the same. (Under FSDP the forward all-gathers parameters: its scores are blurred.)
Under --pp the strategy enters forward() around each of its stages' own forwards, not the schedule's step, which
also waits for the neighbour stages: so the slowest stage's ranks stand out (strategies/pp.py).
Each rank's means over one agreement window go into its own slots of the agreement's all_reduce (MAX, the other
ranks' slots zero) at the NEXT agreement, when its CUDA events are complete: the figures lag one window.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

# Benchmarks only (bench/rank_timing.py): "0" turns the per-rank timing off, to measure what it costs.
RANK_TIMING_ENV = "DDP_CIFAR_RANK_TIMING"
FIELDS = 3  # per rank, seconds per step: wall clock, own work (data wait + forward), data wait
T = TypeVar("T")


class RankTimer:
    def __init__(self, device: torch.device, world_size: int, enabled: bool = True) -> None:
        self.cuda, self.world, self.enabled = device.type == "cuda", world_size, enabled
        self.pending: tuple[float, ...] = (0.0,) * FIELDS  # this rank's last complete window, sent next
        self.restart()

    def restart(self) -> None:
        """A new window: at an epoch's start and after a pause that is not steps (a checkpoint)."""
        self.start, self.steps, self.data_s, self.fwd_s = time.perf_counter(), 0, 0.0, 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def batches(self, source: Iterable[T]) -> Iterator[T]:
        """The loader's batches, each fetch timed."""
        return self._timed(source) if self.enabled else iter(source)

    def _timed(self, source: Iterable[T]) -> Iterator[T]:
        it = iter(source)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.data_s += time.perf_counter() - t0
            self.steps += 1
            yield item

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around the model's forward (each micro-batch's)."""
        if not self.enabled:
            yield
        elif self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.events.append((begin, end))
        else:
            t0 = time.perf_counter()
            yield
            self.fwd_s += time.perf_counter() - t0

    def send(self) -> tuple[float, ...]:
        """What this rank puts into the agreement: its previous window's means (none when disabled)."""
        return self.pending if self.enabled else ()

    def window_done(self, gathered: list[float]) -> list[tuple[float, ...]] | None:
        """After the agreement (every kernel of this window done): close this window into `pending`; returns
        every rank's figures of the previous window, index = rank (None before the first complete window)."""
        if not self.enabled:
            return None
        fwd = self.fwd_s + sum(b.elapsed_time(e) for b, e in self.events) / 1e3
        n = max(self.steps, 1)
        self.pending = ((time.perf_counter() - self.start) / n, (self.data_s + fwd) / n, self.data_s / n)
        rows = [tuple(gathered[r * FIELDS:(r + 1) * FIELDS]) for r in range(self.world)]
        self.restart()
        return rows if rows and all(row[0] > 0 for row in rows) else None


def enabled_by_env() -> bool:
    return os.environ.get(RANK_TIMING_ENV, "1") != "0"
