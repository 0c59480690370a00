"""A torchrun worker for test_trainer_ranks: the trainer, except that global rank 1's model forward takes
SLOW_S longer (a throttled GPU or CPU, as a real straggler's compute would). The others wait for it in DDP's
all-reduce, so every rank's step wall clock is the same; its own work (data wait + forward) is what differs.
The delay sits on the model's head (its last Linear), which every forward runs once: under --pp 2 only the last
stage runs it, so rank 1's stage is the slow one and stage 0 waits for its gradients."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from trainer import models
from trainer.__main__ import main

SLOW_S = 0.03
_for_run = models.for_run


def slowed_by(seconds: float) -> Callable[[Any], nn.Module]:
    """models.for_run, with every forward of the model's head (its last Linear) `seconds` longer."""
    def for_run(cfg: Any) -> nn.Module:
        model = _for_run(cfg)
        head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
        head.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
        return model
    return for_run


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        models.for_run = slowed_by(SLOW_S)
    sys.exit(main(sys.argv[1:]))
