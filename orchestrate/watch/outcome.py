"""The pure readings of a failed node (divergence, OOM); how an attempt ended is orchestrate/outcome.py's."""

from __future__ import annotations

from trainer.contract import DIVERGED_LINE


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
