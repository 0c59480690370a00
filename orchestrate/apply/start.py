"""Start the planned containers: the job's leftovers removed first, then every container created, then all started."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrate.config import UpConfig
from orchestrate.jobs.control import kill_on_host, uid_of
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out


def remove_leftovers(nodes: Nodes, config: UpConfig, grace: float, ranks: Sequence[int]) -> None:
    """Exited containers of the job (or, with --replace, running ones) are removed before the new start.

    `ranks`: the nodes where preflight found containers of the job.
    """
    fan_out("cleanup", list(ranks), lambda r: kill_on_host(nodes.docker(r), config.job, grace, nodes.hosts[r].label,
                                                  uid_of(nodes, r)),
            lambda r: nodes.hosts[r].label)


def start_containers(nodes: Nodes, specs: Sequence[NodeSpec]) -> list[Any]:
    """Create every container first, then start them all. If a create or a start fails on any node, every
    container already created (on the other nodes too) is removed: a failed launch leaves nothing behind."""
    created: list[Any] = [None] * len(specs)

    def create(r: int) -> Any:
        created[r] = _create(nodes.docker(r), specs[r])
        return created[r]

    ranks = list(range(len(specs)))
    try:
        fan_out("create", ranks, create, lambda r: specs[r].host.label)
        fan_out("start", ranks, lambda r: created[r].start(), lambda r: specs[r].host.label)
    except Exception:
        for c in created:
            try:
                if c is not None:
                    c.remove(force=True)
            except Exception:  # best effort; the failure itself is raised below
                pass
        raise
    return created


def _create(client: Any, spec: NodeSpec) -> Any:
    kwargs = spec.sdk_kwargs()
    kwargs.pop("detach")
    return client.containers.create(**kwargs)
