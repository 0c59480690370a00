"""The base-pull policy carried out: where the plan says so, a node pulls the image's base from its registry before
it is sent the layers above it (image.py); a node whose pull fails gets the base's layers sent instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console

from orchestrate.fanout import fan_out
from orchestrate.plan.jobplan import JobPlan
from orchestrate.remote.session import Session


def base_first(nodes: Session, plan: JobPlan, image: str, console: Console) -> dict[int, int]:
    """Where the plan says so, the node pulls the image's base from its registry; then, per node that gets layers
    sent, the first layer sent. A node that lacks the base and does not pull it, or whose pull fails, gets its
    layers sent: one line per reason says why, naming the nodes (before the pulls, or after a failed one)."""
    actions = {n.rank: n.image for n in plan.nodes if n.image.kind == "send"}
    _say(nodes, image, console, {r: f"base not pulled by the node: {a.base_why}; sending its layers"
                                 for r, a in actions.items() if a.base_why})
    failed = pull_bases(nodes, {r: a.pull_base for r, a in actions.items() if a.pull_base})
    _say(nodes, image, console, {r: f"pulling base {a.pull_base} failed ({failed[r]}); sending its layers"
                                 if r in failed else f"pulled base {a.pull_base} from its registry"
                                 for r, a in actions.items() if a.pull_base})
    return {r: a.layers_held if r in failed else a.sent_from for r, a in actions.items()}


def _say(nodes: Session, image: str, console: Console, lines: Mapping[int, str]) -> None:
    """One line per distinct outcome, naming the nodes it happened on."""
    grouped: dict[str, list[str]] = {}
    for rank in sorted(lines):
        grouped.setdefault(lines[rank], []).append(nodes.hosts[rank].label)
    for line, labels in grouped.items():
        console.print(f"image {image} on {', '.join(labels)}: {line}", markup=False, highlight=False, soft_wrap=True)


def pull_bases(nodes: Session, refs: Mapping[int, str]) -> dict[int, str]:
    """Each node pulls its base (by digest), all in parallel; returns why, per node where the pull failed."""
    failed: dict[int, str] = {}

    def one(rank: int) -> None:
        try:
            nodes.docker(rank, timeout=3600).images.pull(refs[rank])
        except Exception as err:  # any failure sends the base's layers instead: reported, never raised
            failed[rank] = str(err) or type(err).__name__

    fan_out("base pull", list(refs), one, lambda r: nodes.hosts[r].label)
    return failed
