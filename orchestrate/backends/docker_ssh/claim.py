"""Claim the GPU set and the master port safely against other `up`s started at the same moment.

Preflight chose the set from the labels it read; another `up` may have read the same labels. So the containers
are created (not started), the other containers' labels on each daemon are read again, and where a claim
overlaps one created earlier (plan/gpuset.py says why this order), this `up` removes its containers, waits a
short random time and plans again from fresh labels: a bounded number of times, each said in one line.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from orchestrate import pauses
from orchestrate.backends.docker_ssh.observe import created_claim, read_holdings
from orchestrate.backends.docker_ssh.start import start_containers
from orchestrate.backends.protocol import Replan
from orchestrate.errors import JobError
from orchestrate.fanout import fan_out
from orchestrate.labels import JOB_LABEL, OWNER_UID_LABEL, PORT_LABEL
from orchestrate.plan import gpuset
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.probe.observations import Held, Holdings
from orchestrate.remote.session import Session

MAX_TRIES = 8  # claims lost in a row before giving up: each loss means another job just took what we wanted
BACKOFF_S = (0.2, 0.8)  # the random wait after the first loss, doubled after each further one (at most 8x)


class ClaimLost(Exception):
    """Another job created its containers first and holds some of what this job's containers claim."""


@dataclass
class Claim:
    """What a successful claim started, and what it took to get there (the figures the issue asks for)."""

    containers: list[Any]
    specs: list[ContainerSpec]
    port: int | None
    tries: int = 1
    lost: list[str] = field(default_factory=list)  # one line per claim lost
    waited_s: float = 0.0


def start_claimed(nodes: Session, specs: list[ContainerSpec], replan: Replan, console: Console) -> Claim:
    """Create, check the claim, start; on a lost claim remove, wait and have the pipeline plan again from the
    labels the daemons hold now (`replan`)."""
    claim = Claim([], specs, _port_of(specs))
    pauses.installed().before_claim()  # where another `up` may claim the same GPUs (orchestrate/pauses.py)
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
            claim.port, claim.specs = replan(_observe(nodes, claim.specs))


def _port_of(specs: Sequence[ContainerSpec]) -> int | None:
    """The master port the plan gives node 0 (its label)."""
    text = specs[0].labels.get(PORT_LABEL, "") if specs else ""
    return int(text) if text.isdigit() else None


def _observe(nodes: Session, specs: Sequence[ContainerSpec]) -> list[Holdings]:
    """The labels each daemon holds now (the job's own of this owner aside)."""
    def one(r: int) -> Holdings:
        labels = specs[r].labels
        return read_holdings(nodes.docker(r), labels[JOB_LABEL], int(labels.get(OWNER_UID_LABEL, "-1")))

    return fan_out("claim", list(range(len(specs))), one, lambda r: nodes.hosts[r].label)


def _check(nodes: Session, specs: Sequence[ContainerSpec], made: list[Any]) -> None:
    """Raise ClaimLost when a container created before ours, on the same daemon, overlaps our claim."""
    ours = {c.id for c in made if c is not None}

    def winners(r: int) -> list[Held]:
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
