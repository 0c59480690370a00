"""The resume checkpoint as a fact about the nodes: the newest valid one anywhere (the newest step after an attempt
is read through the backend: watch/report.py), each node's folder read through the backend (Daemons.newest_checkpoint:
the probe names no connection). Read-only: putting it on the nodes that lack it is the backend's work at the start
(Backend.place_resume_checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from rich.console import Console

from orchestrate.errors import NoCheckpointError
from orchestrate.fanout import fan_out
from orchestrate.probe.daemons import Daemons
from orchestrate.probe.observations import Checkpoint, ResumePoint

NodesT = TypeVar("NodesT")


def find_resume_checkpoint(daemons: Daemons[NodesT], nodes: NodesT, labels: Sequence[str], ckpt_dirs: Sequence[str],
                           console: Console) -> ResumePoint:
    """The newest valid checkpoint on any node (node rank r: host `labels[r]`, its folder `ckpt_dirs[r]`), and the
    nodes that lack it. A newer checkpoint that fails its manifest's size or sha256 is skipped with a warning."""
    def search(r: int) -> Checkpoint | None:
        def skipped(path: str) -> None:
            console.print(f"warning: {labels[r]}:{path}: the checkpoint does not match its manifest "
                          "(missing, or another size or sha256): skipped", markup=False, highlight=False)
        return daemons.newest_checkpoint(nodes, r, ckpt_dirs[r], skipped)

    found = fan_out("checkpoint search", list(range(len(ckpt_dirs))), search, lambda r: labels[r])
    valid = [c for c in found if c is not None]
    if not valid:
        where = ", ".join(f"{label}:{d}" for label, d in zip(labels, ckpt_dirs, strict=True))
        raise NoCheckpointError(f"--resume: no valid checkpoint of this job in {where}; start it without --resume")
    best = max(valid, key=lambda c: c.step)
    src = next(r for r, c in enumerate(found) if c is not None and c.step == best.step)
    console.print(f"resuming from {best.host}:{best.path} (epoch {best.epoch}, step {best.step}, "
                  f"sha256 verified)", markup=False, highlight=False)
    lacking = tuple(r for r, c in enumerate(found) if r != src and (c is None or c.step != best.step))
    return ResumePoint(best, src, lacking)
