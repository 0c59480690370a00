"""Backends turn a plan into the request a scheduler is given, carry it out, and report on it: the Backend protocol
(protocol.py). Each is one folder here and one line in BACKENDS. A scheduler that grants the hosts and queues the
jobs while a backend runs the containers (Scheduler in protocol.py) is one folder here and one line in SCHEDULERS.
Nothing above this folder names either: the composition root (api.py) chooses the backend from BACKENDS
(choice.py) and passes it down; the command line and `jobs/` ask SCHEDULERS."""

from __future__ import annotations

from orchestrate.backends.protocol import Scheduler
from orchestrate.backends.slurm import Slurm

SCHEDULERS: tuple[Scheduler, ...] = (Slurm(),)
