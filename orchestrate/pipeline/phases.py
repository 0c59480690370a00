"""The apply phases of an attempt as `up` strings them together: the image, the data and the start, each carrying
out what the plan says."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rich.console import Console

from orchestrate.backends.docker_ssh import carried
from orchestrate.backends.docker_ssh.data import make_dirs, prefetch_all
from orchestrate.backends.docker_ssh.datasync import stage_all
from orchestrate.backends.docker_ssh.image import ensure_images
from orchestrate.backends.docker_ssh.relay import relay_address
from orchestrate.backends.protocol import Backend, Submitted
from orchestrate.config import UpConfig
from orchestrate.errors import JobError
from orchestrate.fanout import fan_out
from orchestrate.jobs.memory import remember
from orchestrate.pipeline.ready import PreflightedHosts
from orchestrate.plan.jobplan import ContainerSpec, JobPlan, PlanInputs, container_specs
from orchestrate.plan.regrant import regrant
from orchestrate.probe.imagecheck import check_image
from orchestrate.probe.observations import Holdings
from orchestrate.remote.session import Session


def images(ready: PreflightedHosts[Session], plan: JobPlan, config: UpConfig, console: Console) -> JobPlan:
    """The image onto every node as planned; then, where node 0 had to pull it first, the launcher read from it."""
    ensure_images(ready.nodes, plan, ready.local, ready.local_id, console, config.delivery.layer_cache,
                  carried.source(config.delivery.image_from, ready.local_id))
    if plan.launcher is not None:
        return plan
    check = plan.image_check
    assert check is not None  # planned with the attempt (plan/shortlived.py)
    return plan.with_launcher(check_image(config.program, None if config.delivery.pull else ready.local_id,
                                          lambda: ready.backend.image_check(ready.nodes, check, None)))


def data(nodes: Session, plan: JobPlan, config: UpConfig, console: Console) -> None:
    """Every node's data as planned: CIFAR-10 (downloaded, or its archive sent, where no verified copy is), a
    folder or file of --data-from synced, or only the folders made for another program."""
    conns, dirs = nodes.connected(), [n.dirs for n in plan.nodes]
    kind = plan.nodes[0].data.kind  # one kind for all nodes but "present" (a verified copy already there)
    if kind == "sync":
        for line in stage_all(conns, dirs, config.data, console, plan.relay_mode,
                              lambda rank: relay_address(nodes, rank, plan.master)):
            console.print(line, markup=False, highlight=False)
        return
    if kind == "none":
        fan_out("dirs", list(range(len(conns))), lambda r: make_dirs(conns[r], dirs[r]), lambda r: conns[r].host.label)
        return
    fetches = [n.fetch for n in plan.nodes]  # none where a verified copy is present
    for res in prefetch_all(nodes, dirs, fetches, config.data, console, plan.relay_mode, plan.master):
        what = {"present": "verified copy present, nothing moved", "downloaded": f"downloaded {res.bytes_moved} bytes",
                "sent": f"sent {res.bytes_moved} bytes",
                "relayed": f"archive fetched from the relay on {res.shared_with}, 0 bytes sent from here",
                "shared": f"same folder as on {res.shared_with} (shared storage), nothing moved"}[res.action]
        console.print(f"data on {res.label}: {what}", markup=False, highlight=False)


def start(nodes: Session, plan: JobPlan, inputs: PlanInputs, ready: PreflightedHosts[Session], config: UpConfig,
          console: Console) -> Submitted:
    """The resume checkpoint where it lacks, then the attempt submitted to the backend: leftovers out, the
    containers started, their GPU sets and port claimed against other `up`s starting at the same moment (a lost
    claim is planned again here, from what the daemons hold then: the plan returned is the one that started)."""
    ready.backend.place_resume_checkpoint(nodes, plan, lambda line: console.print(line, markup=False, highlight=False))
    remember(config)  # the user's options: a port preflight chose is not kept

    def replan(found: Sequence[Holdings]) -> tuple[int | None, list[ContainerSpec]]:
        # `config` is the user's: its master port None when preflight chose one (a lost claim chooses again). The
        # launcher is the plan's: an image pulled since the inputs were made may have answered it.
        port, new_facts = regrant(config.resources, config.where, nodes.hosts, inputs.node_facts,
                                  ready.reports[0].listening, found)
        return port, container_specs(dataclasses.replace(inputs, facts=tuple(new_facts), master_port=port,
                                                         launcher=plan.launcher))

    submitted = ready.backend.submit(nodes, plan, config.resilience.grace, replan, console)
    _unless_stopped(ready.backend, nodes, config)
    return submitted


def _unless_stopped(backend: Backend[Session], nodes: Session, config: UpConfig) -> None:
    """A kill that listed no container before they were created left its stop record first: seen here, the
    containers just started are removed and the job ends as the kill asked (the races: jobs/stops.py)."""
    if backend.stop_record_seen(nodes, config.program.job):
        backend.remove(nodes, config.program.job, config.resilience.grace, nodes.reachable())
        raise JobError(f"job {config.program.job!r} was stopped with 'kill' as it started; its containers were removed, "
                       "nothing runs, no restart follows")
