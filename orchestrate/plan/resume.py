"""Which checkpoint an attempt resumes from, and which nodes it is copied to, decided from what the probe saw: each
node's newest valid checkpoint (probe/resume.py reads the folders; a checkpoint that fails its manifest is not
among them). Pure: the copy itself is the scheduler's work at the start (Scheduler.place_resume_checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.errors import NoCheckpointError
from orchestrate.probe.observations import Checkpoint


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint the attempt starts from: the newest valid one on any node."""

    checkpoint: Checkpoint
    source: int  # the node that holds it
    copy_to: tuple[int, ...]  # nodes that lack it: it is copied there before the start


def choose_resume(found: Sequence[Checkpoint | None], labels: Sequence[str], ckpt_dirs: Sequence[str]) -> ResumePoint:
    """PURE: from each node's newest valid checkpoint (node rank r: host `labels[r]`, folder `ckpt_dirs[r]`; None:
    none there), the newest of all, the first node holding it, and the nodes that hold another step or none.
    NoCheckpointError when no node holds one."""
    valid = [c for c in found if c is not None]
    if not valid:
        where = ", ".join(f"{label}:{d}" for label, d in zip(labels, ckpt_dirs, strict=True))
        raise NoCheckpointError(f"--resume: no valid checkpoint of this job in {where}; start it without --resume")
    best = max(valid, key=lambda c: c.step)
    source = next(r for r, c in enumerate(found) if c is not None and c.step == best.step)
    lacking = tuple(r for r, c in enumerate(found) if r != source and (c is None or c.step != best.step))
    return ResumePoint(best, source, lacking)


def resume_line(point: ResumePoint) -> str:
    """What `up` says of the choice."""
    best = point.checkpoint
    return f"resuming from {best.host}:{best.path} (epoch {best.epoch}, step {best.step}, sha256 verified)"
