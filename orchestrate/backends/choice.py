"""The backends by name, and the one a command runs with: chosen once, where the command is composed (api.py), and
passed down to the pipeline, the checks and the job commands, which never look one up themselves (lint contract
`backend-given`)."""

from __future__ import annotations

from typing import Any

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.backends.protocol import Backend

# Each backend runs its commands over a connection of its own type (Docker over SSH: its SSH Session); whoever is
# given one only hands back the connection that backend opened, so the registry names none (Any).
BACKENDS: dict[str, Backend[Any]] = {"docker_ssh": DockerSSH()}
DEFAULT = "docker_ssh"


def backend(name: str = DEFAULT) -> Backend[Any]:
    """The registered backend `name`."""
    return BACKENDS[name]
