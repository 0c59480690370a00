"""The apply phases of an attempt as `up` strings them together: the image, the data and the start, each carrying
out what the plan says."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rich.console import Console

from orchestrate.backends.protocol import NodesT, Scheduler, Submitted
from orchestrate.config import UpConfig
from orchestrate.errors import JobError
from orchestrate.jobs.memory import remember
from orchestrate.pipeline.ready import PreflightedHosts
from orchestrate.plan.jobplan import ContainerSpec, JobPlan, PlanInputs, container_specs
from orchestrate.plan.regrant import regrant
from orchestrate.probe.imagecheck import check_image
from orchestrate.probe.observations import Holdings


def images(ready: PreflightedHosts[NodesT], plan: JobPlan, config: UpConfig, console: Console) -> JobPlan:
    """The image onto every node as planned (by the scheduler); then, where node 0 had to pull it first, the launcher
    read from it."""
    ready.scheduler.send_image(ready.nodes, plan, ready.local, ready.local_id, config.delivery, console)
    if plan.launcher is not None:
        return plan
    check = plan.image_check
    assert check is not None  # planned with the attempt (plan/shortlived.py)
    return plan.with_launcher(check_image(config.program, None if config.delivery.pull else ready.local_id,
                                          lambda: ready.scheduler.image_check(ready.nodes, check, None)))


def data(ready: PreflightedHosts[NodesT], plan: JobPlan, config: UpConfig, console: Console) -> None:
    """Every node's data as planned, by the scheduler (CIFAR-10 fetched or sent where no verified copy is,
    --data-from synced, or only the folders made)."""
    ready.scheduler.send_data(ready.nodes, plan, config.data, console)


def start(ready: PreflightedHosts[NodesT], plan: JobPlan, inputs: PlanInputs, config: UpConfig,
          console: Console) -> Submitted:
    """The resume checkpoint where it lacks, then the attempt submitted to the scheduler: leftovers out, the
    containers started, their GPU sets and port claimed against other `up`s starting at the same moment (a lost
    claim is planned again here, from what the daemons hold then: the plan returned is the one that started)."""
    nodes = ready.nodes
    ready.scheduler.place_resume_checkpoint(nodes, plan, lambda line: console.print(line, markup=False, highlight=False))
    remember(config)  # the user's options: a port preflight chose is not kept

    def replan(found: Sequence[Holdings]) -> tuple[int | None, list[ContainerSpec]]:
        # `config` is the user's: its master port None when preflight chose one (a lost claim chooses again). The
        # launcher is the plan's: an image pulled since the inputs were made may have answered it.
        port, new_facts = regrant(config.resources, config.where, ready.hosts, inputs.node_facts,
                                  ready.reports[0].listening, found)
        return port, container_specs(dataclasses.replace(inputs, facts=tuple(new_facts), master_port=port,
                                                         launcher=plan.launcher))

    submitted = ready.scheduler.submit(nodes, plan, config.resilience.grace, replan, console)
    _unless_stopped(ready.scheduler, nodes, len(ready.hosts), config)
    return submitted


def _unless_stopped(scheduler: Scheduler[NodesT], nodes: NodesT, count: int, config: UpConfig) -> None:
    """A kill that listed no container before they were created left its stop record first: seen here, the
    containers just started are removed and the job ends as the kill asked (the races: jobs/stops.py)."""
    if scheduler.stop_record_seen(nodes, config.program.job):
        scheduler.remove(nodes, config.program.job, config.resilience.grace, list(range(count)))
        raise JobError(f"job {config.program.job!r} was stopped with 'kill' as it started; its containers were removed, "
                       "nothing runs, no restart follows")
