"""The schedulers by name, and the one a command runs with: chosen once, where the command is composed (api.py), and
passed down to the pipeline, the checks and the job commands, which never look one up themselves (lint contract
`backend-given`)."""

from __future__ import annotations

from typing import Any

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.backends.protocol import Scheduler

# Each scheduler runs its commands over a connection of its own type (Docker over SSH: its SSH Session); whoever is
# given one only hands back the connection that scheduler opened, so the registry names none (Any).
SCHEDULERS: dict[str, Scheduler[Any]] = {"docker_ssh": DockerSSH()}
DEFAULT = "docker_ssh"


def scheduler(name: str = DEFAULT) -> Scheduler[Any]:
    """The registered scheduler `name`."""
    return SCHEDULERS[name]
