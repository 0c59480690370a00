"""A deterministic bug planted in the trainer, for the tests of what happens when a run crashes: with
CRASH_AT_STEP=N in its environment, global rank 0 raises RuntimeError right after its step N (before that step's
log line), as a bug in the step would.

Two ways in, both through the trainer's public per-step call (trainer.metrics.Heartbeat.step_done, which global
rank 0 alone has enabled):
- as the program: `python crash_at_step.py TRAINER-ARGS` (or torchrun's entry), the trainer with the bug planted;
- in the image tests/programs/crash_at_step/Dockerfile builds on the test image: crash_at_step.pth plants it in
  every Python process that starts with CRASH_AT_STEP set, so that `up` still runs its own entry (`-m trainer`,
  with the data, resume and checkpoints it gives the trainer) and the container's trainer crashes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENV = "CRASH_AT_STEP"
METRICS = "trainer.metrics"


def crash_step() -> int:
    """N of CRASH_AT_STEP=N; 0 (no crash) when unset."""
    return int(os.environ.get(ENV, "0") or 0)


def plant(metrics: ModuleType, step: int) -> None:
    """Make global rank 0 raise right after `step` (its Heartbeat is the enabled one)."""
    done = metrics.Heartbeat.step_done

    def step_done(self: Any, at: int, epoch: int, loss: float | None) -> None:
        if self.enabled and at == step:
            raise RuntimeError(f"injected crash at step {at} ({ENV}, tests/programs/crash_at_step)")
        done(self, at, epoch, loss)

    metrics.Heartbeat.step_done = step_done


class _PlantOnImport(importlib.abc.MetaPathFinder):
    """Plants the crash when trainer.metrics is first imported: the .pth imports nothing of the trainer (nor torch)
    while the interpreter starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != METRICS:
            return None
        sys.meta_path.remove(self)  # once; the ordinary finders find the module
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec else None
        if spec is None or not isinstance(loader, importlib.abc.Loader):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            plant(module, self.step)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def plant_on_import() -> None:
    """crash_at_step.pth's line: with CRASH_AT_STEP set, plant the crash once the trainer loads its metrics."""
    if crash_step():
        sys.meta_path.insert(0, _PlantOnImport(crash_step()))


if __name__ == "__main__":
    from trainer import metrics as trainer_metrics
    from trainer.__main__ import exit_without_finalizing, main

    plant(trainer_metrics, crash_step())
    exit_without_finalizing(main(sys.argv[1:]))
