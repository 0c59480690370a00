"""Start the planned containers: the resume checkpoint copied where it lacks, the job's leftovers removed, then
every container created, then all started."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from orchestrate.backends.docker_ssh.checkpoints import validate
from orchestrate.backends.docker_ssh.ckptrelay import relay_checkpoint
from orchestrate.backends.docker_ssh.control import kill_on_host, uid_of
from orchestrate.backends.docker_ssh.replicate import copy_checkpoint
from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.fanout import fan_out
from orchestrate.plan.jobplan import ContainerSpec, JobPlan
from orchestrate.plan.relay import plan_copy_relay
from orchestrate.remote.session import Session

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient
    from docker.models.containers import Container


def copy_resume_checkpoint(nodes: Session, plan: JobPlan, say: Callable[[str], None],
                           address_of: Callable[[int], str]) -> None:
    """The plan's resume checkpoint onto the nodes that lack it, so every rank can load it: served by the node that
    holds it to the others (`--relay`, plan_copy_relay; `address_of(rank)`: a node's address as the others reach
    it), or copied through here, as are the nodes that could not fetch it (ckptrelay.py says why, by `say`)."""
    if plan.resume is None:
        return
    best, src = plan.resume.checkpoint, plan.resume.source

    def folder(rank: int) -> str:
        return plan.nodes[rank].dirs["ckpt"]

    lacking = [rank for rank in plan.resume.copy_to if validate(nodes.conn(rank), folder(rank), best.manifest_name)
               is None]
    chosen = plan_copy_relay(plan.relay_mode, src, lacking)
    through_here = lacking if chosen.relay is None else \
        sorted(relay_checkpoint(nodes, chosen, best, folder, address_of, say))
    for rank in through_here:
        copy_checkpoint(nodes.conn(src), best, nodes.conn(rank), folder(rank))


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
