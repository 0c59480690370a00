"""This machine's own files: where caches live, and how a file is written whole or not at all; and how a helper
program started here (a local registry, TensorBoard) is ended."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.atomic import write_atomic


def cache_root() -> Path:
    """$XDG_CACHE_HOME/ddp-cifar (default ~/.cache/...): what can be made again, deleting it is always safe."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp-cifar"


def state_root() -> Path:
    """$XDG_STATE_HOME/ddp-cifar (default ~/.local/state/...): what this machine remembers of its jobs."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "ddp-cifar"


def write_atomically(path: Path, chunks: Iterable[bytes]) -> None:
    """trainer.atomic's write into a folder made first; 0600: what this machine keeps is its user's alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, chunks, mode=0o600)


def end_child(child: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL when it has not exited 10 s later."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)
