"""The resume checkpoint as a fact about the nodes: the newest valid one anywhere (copied to the nodes that lack it,
so every rank can load it), and the newest step after an attempt."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from orchestrate.errors import NoCheckpointError
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.probe.checkpoints import Checkpoint, copy_checkpoint, newest_valid, validate
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out


def find_resume_checkpoint(nodes: Nodes, specs: Sequence[NodeSpec], console: Console) -> Checkpoint:
    """The newest valid checkpoint on any node; copied to nodes that lack it so every rank can load it. A newer
    checkpoint that fails its manifest's size or sha256 is skipped with a warning."""
    def search(r: int) -> Checkpoint | None:
        def skipped(path: str) -> None:
            console.print(f"warning: {nodes.hosts[r].label}:{path}: the checkpoint does not match its manifest "
                          "(missing, or another size or sha256): skipped", markup=False, highlight=False)
        return newest_valid(nodes.conn(r), specs[r].dirs["ckpt"], skipped)

    found = fan_out("checkpoint search", list(range(len(specs))), search, lambda r: nodes.hosts[r].label)
    valid = [c for c in found if c is not None]
    if not valid:
        dirs = ", ".join(f"{s.host.label}:{s.dirs['ckpt']}" for s in specs)
        raise NoCheckpointError(f"--resume: no valid checkpoint of this job in {dirs}; start it without --resume")
    best = max(valid, key=lambda c: c.step)
    src = next(r for r, c in enumerate(found) if c is not None and c.step == best.step)
    console.print(f"resuming from {best.host}:{best.path} (epoch {best.epoch}, step {best.step}, "
                  f"sha256 verified)", markup=False, highlight=False)
    for rank, spec in enumerate(specs):
        have = found[rank]
        if rank != src and (have is None or have.step != best.step):
            if validate(nodes.conn(rank), spec.dirs["ckpt"], best.manifest_name) is None:
                copy_checkpoint(nodes.conn(src), best, nodes.conn(rank), spec.dirs["ckpt"])
    return best



def newest_step(nodes: Nodes, specs: Sequence[NodeSpec]) -> int | None:
    """The newest valid checkpoint's step on the nodes that still answer (None: none anywhere)."""
    def one(rank: int) -> int | None:
        try:
            found = newest_valid(nodes.conn(rank), specs[rank].dirs["ckpt"])
        except Exception:  # an unreachable node has nothing to offer
            return None
        return found.step if found else None

    steps = [s for s in fan_out("checkpoint search", list(range(len(specs))), one, lambda r: specs[r].host.label)
             if s is not None]
    return max(steps, default=None)
