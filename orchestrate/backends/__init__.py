"""Backends turn a plan into the request a scheduler is given, carry it out, and report on it: the Backend protocol
(protocol.py). Each is one folder here and one line in BACKENDS. A scheduler that grants the hosts and queues the
jobs while a backend runs the containers (Scheduler in protocol.py) is one folder here and one line in SCHEDULERS.
Nothing above this folder names either; it asks `backend()` and SCHEDULERS."""

from __future__ import annotations

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.backends.protocol import Backend, Scheduler
from orchestrate.backends.slurm import Slurm

BACKENDS: dict[str, Backend] = {"docker_ssh": DockerSSH()}
DEFAULT = "docker_ssh"
SCHEDULERS: tuple[Scheduler, ...] = (Slurm(),)


def backend(name: str = DEFAULT) -> Backend:
    """The registered backend `name`."""
    return BACKENDS[name]
