"""What the containers on one daemon hold (GPU sets, node 0's master port), read from their labels.

Every container counts, whoever started it; the caller's own containers of this job are kept apart, since the
job replaces them (`--replace`) or follows them (a restart keeps their GPUs and port while free).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from orchestrate.labels import GPUS_LABEL, JOB_LABEL, PORT_LABEL, is_mine
from orchestrate.probe.observations import ContainerSeen, Held, Holdings, held, label_ids


def holdings(found: Iterable[ContainerSeen], job: str, uid: int, skip: Collection[str] = ()) -> Holdings:
    """PURE: the claims of the containers `found` on one daemon (the scheduler lists them); `skip`: container IDs that
    are the caller's own claim being checked."""
    others: list[Held] = []
    own_gpus: tuple[int, ...] = ()
    own_port: int | None = None
    for c in found:
        labels = c.labels
        if c.id in skip:
            continue
        if labels.get(JOB_LABEL) == job and is_mine(labels, uid):
            own_gpus = own_gpus or label_ids(labels.get(GPUS_LABEL, ""))
            port = labels.get(PORT_LABEL, "")
            own_port = own_port or (int(port) if port.isdigit() else None)
            continue
        h = held(c.id, labels, c.status, c.created)
        if h is not None:
            others.append(h)
    return Holdings(others, own_gpus, own_port)
