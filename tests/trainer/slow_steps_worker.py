"""A torchrun worker for test_trainer_distributed: the trainer, except that every rank's model forward takes
SLOW_S longer (a large model, or a loaded machine: the steps of the Slurm lease test under load took ~4 s). The
sleep sits on the model's head (its last Linear), which every forward runs once."""

from __future__ import annotations

import sys

from slow_rank_worker import slowed_by

from trainer import models
from trainer.__main__ import main

SLOW_S = 1.2  # over pace.AGREE_WITHIN_S / 2: the cadence agrees every step

if __name__ == "__main__":
    models.for_run = slowed_by(SLOW_S)
    sys.exit(main(sys.argv[1:]))
