"""A torchrun worker for test_trainer_distributed: the trainer, except that global rank 0 gets SIGTERM at the
worst moment, right after the epoch's last stop agreement (during the epoch's loss sum), and rank 1 never does.
A real `docker stop` reaches ranks at different moments; this makes the worst one deterministic."""

from __future__ import annotations

import os
import signal
import sys

import torch

from trainer import dist
from trainer.__main__ import main

_sum_tensor = dist.sum_tensor


def _sum_then_sigterm(ctx: dist.DistContext, t: torch.Tensor) -> torch.Tensor:
    """The first sum is the first epoch's loss total, after its last agreement: the signal lands there."""
    dist.sum_tensor = _sum_tensor
    out = _sum_tensor(ctx, t)
    os.kill(os.getpid(), signal.SIGTERM)
    return out


if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        dist.sum_tensor = _sum_then_sigterm
    sys.exit(main(sys.argv[1:]))
