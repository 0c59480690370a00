"""PURE: a host's boot and its Docker daemon's start as read (Ranks.boot, backends/protocol.py), and what changed
between two readings: how the watcher tells why a node's part stopped answering (the host rebooted, its daemon
restarted or is down while the host answers) without knowing how the scheduler reads them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Boot:
    boot_id: str
    daemon: str | None  # "PID STARTTIME" of the running dockerd; None while none runs


class Change(Enum):
    """What happened to a host since an earlier reading."""

    NONE = "nothing seen"
    REBOOTED = "rebooted"
    RESTARTED = "Docker daemon restarted"
    DAEMON_DOWN = "Docker daemon down"

    @property
    def ended_the_job(self) -> bool:
        """A reboot or a daemon restart ended every container of the host (no live-restore): no need to wait."""
        return self in (Change.REBOOTED, Change.RESTARTED)

    def cause(self, host: str) -> str:
        return {Change.NONE: f"Docker API of {host} does not answer (sshd answers)",
                Change.REBOOTED: f"{host} rebooted",
                Change.RESTARTED: f"Docker daemon on {host} restarted",
                Change.DAEMON_DOWN: f"Docker daemon on {host} is down (sshd answers)"}[self]


def change(before: Boot | None, now: Boot) -> Change:
    """PURE: what happened to the host between two readings (NONE also when there is no earlier one)."""
    if before is None:
        return Change.NONE
    if now.boot_id != before.boot_id:
        return Change.REBOOTED
    if before.daemon is None:  # no pid file where a stock install keeps it: nothing to compare
        return Change.NONE
    if now.daemon is None:
        return Change.DAEMON_DOWN
    return Change.RESTARTED if now.daemon != before.daemon else Change.NONE
