"""A torchrun worker for test_trainer_distributed: the trainer, except that every rank's model forward takes
SLOW_S longer (a large model, or a loaded machine: the steps of the Slurm lease test under load took ~4 s). The
sleep sits on the model's head (its last Linear), which every forward runs once."""

from __future__ import annotations

import sys
import time
from typing import Any

from torch import nn

from trainer import models
from trainer.__main__ import main

SLOW_S = 1.2  # over pace.AGREE_WITHIN_S / 2: the cadence agrees every step
_for_run = models.for_run


def _slow_for_run(cfg: Any) -> nn.Module:
    model = _for_run(cfg)
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    head.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_S))
    return model


if __name__ == "__main__":
    models.for_run = _slow_for_run
    sys.exit(main(sys.argv[1:]))
