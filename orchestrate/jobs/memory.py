"""Local memory of a job: which hosts file and options its last `up` used; and where caches live here.

Only where to look: the containers' labels on the hosts are the truth about what runs.
Stored at $XDG_STATE_HOME/ddp-cifar/jobs/<job>.json (default ~/.local/state/...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.config import UpConfig
from orchestrate.localfs import state_root, write_atomically
from orchestrate.masking import url_masked


def state_dir() -> Path:
    return state_root() / "jobs"


@dataclass(frozen=True)
class JobState:
    job: str
    hosts_file: str
    ssh_config: str | None
    options: dict[str, Any]

    def path(self) -> Path:
        return state_dir() / f"{self.job}.json"


def save(state: JobState) -> Path:
    path = state.path()
    data = {"job": state.job, "hosts_file": state.hosts_file, "ssh_config": state.ssh_config,
            "options": state.options}
    write_atomically(path, [json.dumps(data, indent=2).encode()])
    return path


def load(job: str) -> JobState | None:
    path = state_dir() / f"{job}.json"
    try:
        data = json.loads(path.read_text())
        return JobState(data["job"], data["hosts_file"], data.get("ssh_config"), data.get("options", {}))
    except (OSError, ValueError, KeyError):
        return None


def remember(config: UpConfig) -> Path:
    """The job's every option and its hosts, stored here for `up --job NAME` and `kill`/`status` without --hosts.
    It takes the whole config on purpose: what it stores is every section (a section left out would be forgotten)."""
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in config.options().items()
               if k != "env"}
    options["env_names"] = [k for k, _ in config.program.env]  # values are not stored: they may be secrets
    options["data_url"] = url_masked(config.data.data_url)  # nor a password in the URL
    return save(JobState(config.program.job, str(Path(config.ssh.hosts_file or "").resolve()),
                         str(config.ssh.ssh_config) if config.ssh.ssh_config else None, options))
