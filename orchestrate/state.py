"""Local memory of a job: which hosts file and options its last `up` used.

Only where to look: the containers' labels on the hosts are the truth about what runs.
Stored at $XDG_STATE_HOME/ddp-cifar/jobs/<job>.json (default ~/.local/state/...).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "ddp-cifar" / "jobs"


@dataclass(frozen=True)
class JobState:
    job: str
    hosts_file: str
    ssh_config: str | None
    options: dict[str, Any]

    def path(self) -> Path:
        return state_dir() / f"{self.job}.json"


def save(state: JobState) -> Path:
    """Write atomically so a killed orchestrator never leaves half a file."""
    path = state.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"job": state.job, "hosts_file": state.hosts_file, "ssh_config": state.ssh_config,
            "options": state.options}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{state.job}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)
    return path


def load(job: str) -> JobState | None:
    path = state_dir() / f"{job}.json"
    try:
        data = json.loads(path.read_text())
        return JobState(data["job"], data["hosts_file"], data.get("ssh_config"), data.get("options", {}))
    except (OSError, ValueError, KeyError):
        return None


def mark_killed(job: str) -> None:
    """`kill` leaves this mark: an `up` of the job waiting to restart it (a backoff) sees it and stops."""
    path = state_dir() / f"{job}.killed"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{time.time()}\n")


def killed_since(job: str, since: float) -> bool:
    """Whether `kill` ran for the job after `since` (time.time()) on this machine."""
    try:
        return float((state_dir() / f"{job}.killed").read_text().strip()) >= since
    except (OSError, ValueError):
        return False
