"""Claim the GPU set and the master port safely against other `up`s started at the same moment.

Preflight chose the set from the labels it read; another `up` may have read the same labels. So the containers
are created (not started), the other containers' labels on each daemon are read again, and where a claim
overlaps one created earlier (plan/gpuset.py says why this order), this `up` removes its containers, waits a
short random time and plans again from fresh labels: a bounded number of times, each said in one line.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console

from orchestrate.apply.start import start_containers
from orchestrate.config import UpConfig
from orchestrate.errors import JobError, PreflightError
from orchestrate.jobs.owner import OWNER_UID_LABEL
from orchestrate.plan import gpuset, ports
from orchestrate.plan.jobplan import NodeFacts, NodeSpec
from orchestrate.probe.holdings import created_claim, read_holdings
from orchestrate.remote.docker import JOB_LABEL, PORT_LABEL
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out

MAX_TRIES = 8  # claims lost in a row before giving up: each loss means another job just took what we wanted
BACKOFF_S = (0.2, 0.8)  # the random wait after the first loss, doubled after each further one (at most 8x)


class ClaimLost(Exception):
    """Another job created its containers first and holds some of what this job's containers claim."""


@dataclass
class Claim:
    """What a successful claim started, and what it took to get there (the figures the issue asks for)."""

    containers: list[Any]
    specs: list[NodeSpec]
    port: int | None
    tries: int = 1
    lost: list[str] = field(default_factory=list)  # one line per claim lost
    waited_s: float = 0.0


Replan = Callable[[int | None, Sequence[NodeFacts]], list[NodeSpec]]


def start_claimed(nodes: Nodes, config: UpConfig, specs: list[NodeSpec], facts: Sequence[NodeFacts],
                  present: Sequence[tuple[int, ...]], listening: set[int], replan: Replan,
                  console: Console) -> Claim:
    """Create, check the claim, start; on a lost claim remove, wait and plan again (fresh labels). `config`
    is the user's: its master port None when preflight chose one (a lost claim chooses again)."""
    claim = Claim([], specs, _port_of(specs))
    while True:
        try:
            claim.containers = start_containers(nodes, claim.specs, lambda made: _check(nodes, claim.specs, made))
            return claim
        except ClaimLost as lost:
            if claim.tries >= MAX_TRIES:
                raise JobError(f"{lost}; gave up after {claim.tries} tries: too many jobs starting at once here, "
                               "run 'up' again") from None
            wait = random.uniform(*BACKOFF_S) * 2 ** min(claim.tries - 1, 3)
            claim.lost.append(str(lost))
            console.print(f"claim {claim.tries} lost: {lost}; this job's containers were removed, planning again "
                          f"in {wait:.1f} s", markup=False, highlight=False)
            time.sleep(wait)
            claim.waited_s += wait
            claim.tries += 1
            claim.port, new_facts = regrant(nodes, config, facts, present, listening)
            claim.specs = replan(claim.port, new_facts)


def _port_of(specs: Sequence[NodeSpec]) -> int | None:
    """The master port the plan gives node 0 (its label)."""
    text = specs[0].labels.get(PORT_LABEL, "") if specs else ""
    return int(text) if text.isdigit() else None


def regrant(nodes: Nodes, config: UpConfig, facts: Sequence[NodeFacts], present: Sequence[tuple[int, ...]],
            listening: set[int]) -> tuple[int | None, list[NodeFacts]]:
    """The GPU sets and node 0's port again, from the labels as they are now; one line per host where they no
    longer fit (the jobs that took them are named), and nothing starts."""
    uid = [int((f.user or "-1:").split(":", 1)[0]) for f in facts]
    found = fan_out("claim", list(range(len(facts))), lambda r: read_holdings(nodes.docker(r), config.job, uid[r]),
                    lambda r: nodes.hosts[r].label)
    grants = [gpuset.allocate(config.gpus, config.gpu_ids, present[r], h.others, h.own_gpus) if config.gpus
              else gpuset.Grant() for r, h in enumerate(found)]
    port, port_text = ports.choose(config.master_port, listening, found[0].others, found[0].own_port)
    problems = [f"{nodes.hosts[r].label}: {g.problem}" for r, g in enumerate(grants) if g.problem]
    problems += [] if port is not None else [f"{nodes.hosts[0].label}: {port_text}"]
    if problems:
        raise PreflightError("another job took what this one planned to use; nothing was started:\n  "
                             + "\n  ".join(problems))
    return port, [replace(f, gpu_set=g.gpus) for f, g in zip(facts, grants, strict=True)]


def _check(nodes: Nodes, specs: Sequence[NodeSpec], made: list[Any]) -> None:
    """Raise ClaimLost when a container created before ours, on the same daemon, overlaps our claim."""
    ours = {c.id for c in made if c is not None}

    def winners(r: int) -> list[gpuset.Held]:
        mine = created_claim(made[r])
        if mine is None:
            return []
        uid = int(specs[r].labels.get(OWNER_UID_LABEL, "-1"))
        others = read_holdings(nodes.docker(r), specs[r].labels[JOB_LABEL], uid, skip=ours).others
        return gpuset.yields_to(mine, others)

    lost = fan_out("claim check", list(range(len(specs))), winners, lambda r: specs[r].host.label)
    lines = [f"{specs[r].host.label}: {', '.join(sorted({w.who for w in won}))} created first"
             for r, won in enumerate(lost) if won]
    if lines:
        raise ClaimLost("; ".join(lines))
