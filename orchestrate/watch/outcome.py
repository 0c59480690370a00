"""How an attempt ended (End, Outcome) and the pure readings of a failed node (divergence, OOM)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from trainer.contract import DIVERGED_LINE


class End(Enum):
    """How an attached `up` ended; callers decide on this, never on the wording of `reason`."""

    DONE = "done"
    DETACHED = "detached"  # Ctrl-C, the user chose to leave the job running
    INTERRUPTED = "interrupted"  # Ctrl-C, the job was stopped
    EXITED = "exited"  # a node's container exited non-zero (or was OOM-killed)
    UNREACHABLE = "unreachable"  # a host answered no poll for UNREACHABLE_S
    STALLED = "stalled"  # no new training step (rank 0's heartbeat) for --stall-timeout
    REMOVED = "removed"  # a node's container is gone (another terminal ran `kill`)
    HOST = "host"  # a node's host rebooted, or its Docker daemon restarted or is down while sshd answers

    @property
    def restartable(self) -> bool:
        """Failures of the job itself; a user's kill or Ctrl-C is never undone by a restart."""
        return self in (End.EXITED, End.UNREACHABLE, End.STALLED, End.HOST)


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


def diverged_line(log: str) -> str | None:
    """PURE: the trainer's divergence report (`error: training diverged at step N: loss L, lr R; ...`) from a
    node's log, without its `error: `; None when the node ended otherwise."""
    for line in reversed(log.splitlines()):
        _, found, rest = line.partition(f"error: {DIVERGED_LINE}")
        if found:
            return f"{DIVERGED_LINE}{rest}".strip()
    return None


def oom_reason(limit: str | None) -> str:
    """PURE: why a container that the kernel's OOM killer ended (Docker's State.OOMKilled) failed, and what to do."""
    where = f"its memory limit (--memory {limit})" if limit else "the host's memory (no --memory limit)"
    return (f"killed by the kernel's OOM killer: out of {where}; lower --batch-size, or give it more memory "
            "with --memory (/dev/shm counts too: --shm-size)")
