"""Start the planned containers: the resume checkpoint copied where it lacks, the job's leftovers removed, then
every container created, then all started."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from orchestrate.backends.docker_ssh.control import kill_on_host, uid_of
from orchestrate.backends.docker_ssh.replicate import copy_checkpoint
from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.plan.jobplan import ContainerSpec, JobPlan
from orchestrate.probe.checkpoints import validate
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import fan_out

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient
    from docker.models.containers import Container


def copy_resume_checkpoint(nodes: Session, plan: JobPlan) -> None:
    """The plan's resume checkpoint onto the nodes that lack it, so every rank can load it."""
    if plan.resume is None:
        return
    best, src = plan.resume.checkpoint, plan.resume.source
    for rank in plan.resume.copy_to:
        folder = plan.nodes[rank].dirs["ckpt"]
        if validate(nodes.conn(rank), folder, best.manifest_name) is None:
            copy_checkpoint(nodes.conn(src), best, nodes.conn(rank), folder)


def remove_leftovers(nodes: Session, job: str, grace: float, ranks: Sequence[int]) -> None:
    """Exited containers of the job (or, with --replace, running ones) are removed before the new start.

    `ranks`: the nodes where preflight found containers of the job.
    """
    fan_out("cleanup", list(ranks), lambda r: kill_on_host(nodes.docker(r), job, grace, nodes.hosts[r].label,
                                                  uid_of(nodes, r)),
            lambda r: nodes.hosts[r].label)


def start_containers(nodes: Session, specs: Sequence[ContainerSpec],
                     before_start: Callable[[list[Container]], None] | None = None) -> list[Container]:
    """Create every container first, then start them all. If a create or a start fails on any node, every
    container already created (on the other nodes too) is removed: a failed launch leaves nothing behind.
    `before_start` sees every created container before any starts; what it raises removes them the same way
    (the GPU-set claim check, claim.py)."""
    created: list[Container | None] = [None] * len(specs)

    def create(r: int) -> Container:
        created[r] = made = _create(nodes.docker(r), specs[r])
        return made

    ranks = list(range(len(specs)))
    try:
        made = fan_out("create", ranks, create, lambda r: specs[r].host.label)
        if before_start is not None:
            before_start(made)
        fan_out("start", ranks, lambda r: made[r].start(), lambda r: specs[r].host.label)
    except Exception:
        for c in created:
            try:
                if c is not None:
                    c.remove(force=True)
            except Exception:  # best effort; the failure itself is raised below
                pass
        raise
    return made


def _create(client: DockerClient, spec: ContainerSpec) -> Container:
    kwargs = sdk_kwargs(spec)
    kwargs.pop("detach")
    return client.containers.create(**kwargs)
