"""A torchrun worker for test_trainer_ranks: the trainer, except that global rank 1's model forward takes
SLOW_S longer (a throttled GPU or CPU, as a real straggler's compute would). The others wait for it in DDP's
all-reduce, so every rank's step wall clock is the same; its own work (data wait + forward) is what differs.
The delay sits on the model's head (its last Linear), which every forward runs once: under --pp 2 only the last
stage runs it, so rank 1's stage is the slow one and stage 0 waits for its gradients."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from torch import nn

from trainer import models
from trainer.__main__ import main

SLOW_S = 0.03
_for_run = models.for_run


def _slow_for_run(cfg: Any) -> nn.Module:
    model = _for_run(cfg)
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    head.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_S))
    return model


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        models.for_run = _slow_for_run
    sys.exit(main(sys.argv[1:]))
