"""The allocators that grant the hosts and queue the batch jobs (Allocator, protocol.py), each one line here: the command
line asks every one for its subcommands and `--hosts` value, `status` and `kill` for its side of a job."""

from __future__ import annotations

from orchestrate.backends.protocol import Allocator
from orchestrate.backends.slurm import Slurm

ALLOCATORS: tuple[Allocator, ...] = (Slurm(),)
