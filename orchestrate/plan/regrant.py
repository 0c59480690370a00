"""PURE: after a lost claim, the GPU sets and node 0's port again, from the labels as the daemons hold them now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from orchestrate.config import Resources, Where
from orchestrate.errors import PreflightError
from orchestrate.hosts import Host
from orchestrate.plan import gpuset, ports
from orchestrate.plan.gpus import granted_here
from orchestrate.probe.observations import Holdings, NodeFacts


def regrant(resources: Resources, where: Where, hosts: Sequence[Host], facts: Sequence[NodeFacts],
            present: Sequence[tuple[int, ...]], listening: set[int],
            found: Sequence[Holdings]) -> tuple[int | None, list[NodeFacts]]:
    """The port and every node's facts with its new GPU set; one line per host where they no longer fit (the
    jobs that took them are named), and nothing starts. `hosts`: node 0 first; a host's own grant (`gpu_ids=`, a
    scheduler's) is asked for again as it is, never other indices of that node."""
    labels = [h.label for h in hosts]
    grants = [_allocate(granted_here(resources, hosts[r]), present[r], h) if resources.gpus else gpuset.Grant()
              for r, h in enumerate(found)]
    port, port_text = ports.choose(where.master_port, listening, found[0].others, found[0].own_port)
    problems = [f"{labels[r]}: {g.problem}" for r, g in enumerate(grants) if g.problem]
    problems += [] if port is not None else [f"{labels[0]}: {port_text}"]
    if problems:
        raise PreflightError("another job took what this one planned to use; nothing was started:\n  "
                             + "\n  ".join(problems))
    return port, [replace(f, gpu_set=g.gpus) for f, g in zip(facts, grants, strict=True)]


def _allocate(resources: Resources, present: Sequence[int], found: Holdings) -> gpuset.Grant:
    return gpuset.allocate(resources.gpus, resources.gpu_ids, present, found.others, found.own_gpus)
