"""The apply phases of an attempt as `up` strings them together: the image, the data and the start, each carrying
out what the plan says."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from orchestrate.apply.claim import start_claimed
from orchestrate.apply.data import make_dirs, prefetch_all
from orchestrate.apply.image import ensure_images
from orchestrate.apply.staging import stage_all
from orchestrate.apply.start import copy_resume_checkpoint, remove_leftovers
from orchestrate.config import UpConfig
from orchestrate.errors import JobError
from orchestrate.jobs import stops
from orchestrate.jobs.memory import remember
from orchestrate.plan.jobplan import JobPlan, NodeFacts, build_plan
from orchestrate.probe.imagecheck import check_image
from orchestrate.probe.ready import Ready
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker.models.containers import Container


def images(ready: Ready, plan: JobPlan, config: UpConfig, console: Console) -> JobPlan:
    """The image onto every node as planned; then, where node 0 had to pull it first, the launcher read from it."""
    ensure_images(ready.nodes, plan, ready.local, ready.local_id, console, config.layer_cache)
    if plan.launcher is not None:
        return plan
    return plan.with_launcher(check_image(ready.nodes.conn(0), config, None if config.pull else ready.local_id))


def data(nodes: Nodes, plan: JobPlan, config: UpConfig, console: Console) -> None:
    """Every node's data as planned: CIFAR-10 (downloaded, or its archive sent, where no verified copy is), a
    folder or file of --data-from synced, or only the folders made for another program."""
    conns, dirs = nodes.connected(), [n.dirs for n in plan.nodes]
    kind = plan.nodes[0].data.kind  # one kind for all nodes but "present" (a verified copy already there)
    if kind == "sync":
        for line in stage_all(conns, dirs, config, console):
            console.print(line, markup=False, highlight=False)
        return
    if kind == "none":
        fan_out("dirs", list(range(len(conns))), lambda r: make_dirs(conns[r], dirs[r]), lambda r: conns[r].host.label)
        return
    present = [n.data.kind == "present" for n in plan.nodes]
    for res in prefetch_all(conns, dirs, present, lambda r: nodes.docker(r, timeout=3600), config, console):
        what = {"present": "verified copy present, nothing moved", "downloaded": f"downloaded {res.bytes_moved} bytes",
                "sent": f"sent {res.bytes_moved} bytes",
                "shared": f"same folder as on {res.shared_with} (shared storage), nothing moved"}[res.action]
        console.print(f"data on {res.label}: {what}", markup=False, highlight=False)


def start(nodes: Nodes, plan: JobPlan, facts: list[NodeFacts], ready: Ready, config: UpConfig,
          console: Console) -> tuple[JobPlan, list[Container]]:
    """Leftovers out, then the containers created, their GPU sets and port claimed against other `up`s starting
    at the same moment (a lost claim plans them again: the plan returned is the one that started), started."""
    copy_resume_checkpoint(nodes, plan)
    remove_leftovers(nodes, config, config.grace, [n.rank for n in plan.nodes if n.leftovers])
    remember(config)  # the user's options: a port preflight chose is not kept
    launcher = plan.launcher or ("torchrun",)
    claim = start_claimed(nodes, config, plan.specs, facts, [r.present for r in ready.reports],
                          ready.reports[0].listening,
                          lambda port, f: build_plan(config, nodes.hosts, ready.master, f, launcher, plan.attempt,
                                                     port), console)
    plan = plan.with_claim(claim.specs, claim.port)
    _unless_stopped(nodes, config)
    return plan, claim.containers


def _unless_stopped(nodes: Nodes, config: UpConfig) -> None:
    """A kill that listed no container before they were created left its stop record first: seen here, the
    containers just started are removed and the job ends as the kill asked (the races: jobs/stops.py)."""
    if stops.seen(nodes, config.job):
        remove_leftovers(nodes, config, config.grace, nodes.reachable())
        raise JobError(f"job {config.job!r} was stopped with 'kill' as it started; its containers were removed, "
                       "nothing runs, no restart follows")

