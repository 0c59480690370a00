"""Small disks for the tests of full and read-only folders."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A small tmpfs mounted at `where` (created) for the duration: a disk that fills up, or is read-only
    even for root. Needs root; always unmounted."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
