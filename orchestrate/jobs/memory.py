"""Local memory of a job: which hosts file and options its last `up` used; and where caches live here.

Only where to look: the containers' labels on the hosts are the truth about what runs.
Stored at $XDG_STATE_HOME/ddp-cifar/jobs/<job>.json (default ~/.local/state/...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestrate.config import UpConfig, url_masked
from trainer.atomic import write_atomic


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "ddp-cifar" / "jobs"


def cache_root() -> Path:
    """$XDG_CACHE_HOME/ddp-cifar (default ~/.cache/...): what can be made again, deleting it is always safe."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp-cifar"


def write_atomically(path: Path, chunks: Iterable[bytes]) -> None:
    """trainer.atomic's write into a folder made first; 0600: what this machine keeps is its user's alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, chunks, mode=0o600)


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
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()
               if k not in ("ssh", "env")}
    options["env_names"] = [k for k, _ in config.env]  # values are not stored: they may be secrets
    options["data_url"] = url_masked(config.data_url)  # nor a password in the URL
    return save(JobState(config.job, str(Path(config.ssh.hosts_file or "").resolve()),
                         str(config.ssh.ssh_config) if config.ssh.ssh_config else None, options))
