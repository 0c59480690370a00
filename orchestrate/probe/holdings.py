"""I/O: what the containers on one daemon hold (GPU sets, node 0's master port), read from their labels.

Every container counts, whoever started it; the caller's own containers of this job are kept apart, since the
job replaces them (`--replace`) or follows them (a restart keeps their GPUs and port while free).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from orchestrate.jobs.owner import is_mine
from orchestrate.plan.gpuset import Held, held, label_ids
from orchestrate.remote.docker import GPUS_LABEL, JOB_LABEL, PORT_LABEL


@dataclass(frozen=True)
class Holdings:
    others: list[Held] = field(default_factory=list)  # other jobs' claims, and the caller's other jobs'
    own_gpus: tuple[int, ...] = ()  # what the caller's containers of this job held last
    own_port: int | None = None


def read_holdings(client: Any, job: str, uid: int, skip: Collection[str] = ()) -> Holdings:
    """The claims on this daemon; `skip`: container IDs that are the caller's own claim being checked."""
    others: list[Held] = []
    own_gpus: tuple[int, ...] = ()
    own_port: int | None = None
    for c in _claiming(client):
        labels = c.labels
        if c.id in skip:
            continue
        if labels.get(JOB_LABEL) == job and is_mine(labels, uid):
            own_gpus = own_gpus or label_ids(labels.get(GPUS_LABEL, ""))
            port = labels.get(PORT_LABEL, "")
            own_port = own_port or (int(port) if port.isdigit() else None)
            continue
        h = held(c.id, labels, c.status, c.attrs.get("Created", ""))
        if h is not None:
            others.append(h)
    return Holdings(others, own_gpus, own_port)


def created_claim(container: Any) -> Held | None:
    """The claim of a container this `up` just created (re-read, so its creation time is the daemon's)."""
    container.reload()
    return held(container.id, container.labels, container.status, container.attrs.get("Created", ""))


def _claiming(client: Any) -> list[Any]:
    # ignore_removed: docker-py reads each listed container again, and one removed in between (another `up` that
    # lost its claim removes its containers at that very moment) failed the claim check with a 404 (seen in CI).
    found = {c.id: c for c in client.containers.list(all=True, filters={"label": GPUS_LABEL}, ignore_removed=True)}
    found.update({c.id: c for c in client.containers.list(all=True, filters={"label": PORT_LABEL},
                                                          ignore_removed=True)})
    return list(found.values())

