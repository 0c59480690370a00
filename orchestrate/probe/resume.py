"""What each node holds to resume from: its newest valid checkpoint, each node's folder read through the scheduler
(Daemons.newest_checkpoint: the probe names no connection). Observations only: which one the attempt resumes from,
and where it is copied, is the plan's (plan/resume.py); putting it on the nodes that lack it is the scheduler's work at
the start (Scheduler.place_resume_checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from rich.console import Console

from orchestrate.fanout import fan_out
from orchestrate.probe.daemons import Daemons
from orchestrate.probe.observations import Checkpoint

NodesT = TypeVar("NodesT")


def newest_checkpoints(daemons: Daemons[NodesT], nodes: NodesT, labels: Sequence[str], ckpt_dirs: Sequence[str],
                       console: Console) -> tuple[Checkpoint | None, ...]:
    """Each node's newest valid checkpoint (node rank r: host `labels[r]`, its folder `ckpt_dirs[r]`), None where it
    holds none. A newer checkpoint that fails its manifest's size or sha256 is skipped with a warning."""
    def search(r: int) -> Checkpoint | None:
        def skipped(path: str) -> None:
            console.print(f"warning: {labels[r]}:{path}: the checkpoint does not match its manifest "
                          "(missing, or another size or sha256): skipped", markup=False, highlight=False)
        return daemons.newest_checkpoint(nodes, r, ckpt_dirs[r], skipped)

    return tuple(fan_out("checkpoint search", list(range(len(ckpt_dirs))), search, lambda r: labels[r]))
