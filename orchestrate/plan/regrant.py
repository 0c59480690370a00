"""PURE: after a lost claim, the GPU sets and node 0's port again, from the labels as the daemons hold them now."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from orchestrate.config import Resources, Where
from orchestrate.errors import PreflightError
from orchestrate.hosts import Host
from orchestrate.plan import ports
from orchestrate.plan.gpuset import decide_gpus
from orchestrate.probe.observations import Holdings, NodeFacts


def regrant(resources: Resources, where: Where, hosts: Sequence[Host], facts: Sequence[NodeFacts],
            listening: AbstractSet[int], found: Sequence[Holdings]) -> tuple[int | None, list[NodeFacts]]:
    """The port, and every node's facts with the labels found now (from which the plan decides its GPU set again,
    plan/gpuset.py); one line per host where they no longer fit (the jobs that took them are named), and nothing
    starts. `hosts`: node 0 first; a host's own grant (`gpu_ids=`, an allocator's) is asked for again as it is, never
    other indices of that node."""
    labels = [h.label for h in hosts]
    now = [replace(f, holdings=h) for f, h in zip(facts, found, strict=True)]
    sets = [decide_gpus(resources, host, f.gpu, f.holdings) for host, f in zip(hosts, now, strict=True)]
    port, port_text = ports.choose(where.master_port, listening, found[0].others, found[0].own_port)
    problems = [f"{labels[r]}: {g.why}" for r, g in enumerate(sets) if g.refused]
    problems += [] if port is not None else [f"{labels[0]}: {port_text}"]
    if problems:
        raise PreflightError("another job took what this one planned to use; nothing was started:\n  "
                             + "\n  ".join(problems))
    return port, now
