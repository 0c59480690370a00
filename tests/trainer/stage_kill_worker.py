"""A torchrun worker for test_trainer_pipeline: `stage_kill_worker.py TRAINER-ARGS...` is the trainer, except that
the process of the last stage of a --pp 2 job (global rank 1) SIGKILLs itself inside its first training step's
schedule, right after its stage's first forward: a stage's process lost mid-step, at a moment made deterministic."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from trainer.__main__ import main
from trainer.strategies.pp import PipelineStrategy

_train_step = PipelineStrategy.train_step


def _killed_in_the_step(self: PipelineStrategy, *args: Any, **kwargs: Any) -> Any:
    """The stage's forward of the first micro-batch kills this process (the schedule has received its input)."""
    self.parts[0].register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    return _train_step(self, *args, **kwargs)


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        PipelineStrategy.train_step = _killed_in_the_step  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
