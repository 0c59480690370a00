"""The backends by name, and the one a command runs with: chosen once, where the command is composed (api.py), and
passed down to the pipeline, the checks and the job commands, which never look one up themselves (lint contract
`backend-given`)."""

from __future__ import annotations

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.backends.protocol import Backend
from orchestrate.remote.session import Session

BACKENDS: dict[str, Backend[Session]] = {"docker_ssh": DockerSSH()}
DEFAULT = "docker_ssh"


def backend(name: str = DEFAULT) -> Backend[Session]:
    """The registered backend `name`."""
    return BACKENDS[name]
