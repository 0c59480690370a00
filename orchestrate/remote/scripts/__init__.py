"""Scripts run on the hosts (over SSH) or in short containers there: real files, read by ruff and shellcheck,
sent as they are."""
from __future__ import annotations

from pathlib import Path


def text(name: str) -> str:
    """The script NAME (a file in this folder) as it is sent."""
    return (Path(__file__).parent / name).read_text()
