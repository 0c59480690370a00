"""How an attempt ended (End, Outcome): what the watch observed (watch/), which the restart decision reads
(plan/restarts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class End(Enum):
    """How an attached `up` ended; callers decide on this, never on the wording of `reason`."""

    DONE = "done"
    DETACHED = "detached"  # Ctrl-C, the user chose to leave the job running
    INTERRUPTED = "interrupted"  # Ctrl-C, the job was stopped
    EXITED = "exited"  # a node's container exited non-zero (or was OOM-killed)
    UNREACHABLE = "unreachable"  # a host answered no poll for UNREACHABLE_S
    STALLED = "stalled"  # no new training step (rank 0's heartbeat) for --stall-timeout
    REMOVED = "removed"  # a node's container is gone (another terminal ran `kill`)
    KILLED = "killed"  # a `kill` typed while the job ran stopped it: its stop record is on the hosts (jobs/stops.py)
    HOST = "host"  # a node's host rebooted, or its Docker daemon restarted or is down while sshd answers


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, with its blame; the pipeline acts on it (watch/ only observes)."""

    ok: bool
    end: End
    failed_rank: int | None = None
    reason: str = ""
    leftovers: bool = False  # some node could not be cleaned (unreachable): `kill` later
    host: str | None = None  # the failed node's host

    @property
    def cause(self) -> str:
        """One line for errors, the restart record and `status`: which node, what happened."""
        if self.failed_rank is None:
            return self.reason
        return f"node {self.failed_rank} ({self.host}) {self.reason}" if self.host else \
            f"node {self.failed_rank} {self.reason}"
