"""Who the SSH login is on a host (pure data: the plan reads it without loading SSH)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """Who the SSH login is on a host: containers run as uid:gid, default dirs live under home."""

    uid: int
    gid: int
    name: str
    home: str

    @property
    def user_spec(self) -> str:
        return f"{self.uid}:{self.gid}"
