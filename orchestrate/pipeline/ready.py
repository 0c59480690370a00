"""Connect and preflight: the hosts connected and past preflight, what every command that starts containers needs
first; on a restart with --min-nodes, the hosts that do not answer or fail preflight are left out while enough
remain."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic

from rich.console import Console

from orchestrate.backends.protocol import NodesT, Reached, Scheduler
from orchestrate.config import UpConfig
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.pipeline.preflight import run_preflight
from orchestrate.plan import restarts
from orchestrate.plan.jobplan import Attempt
from orchestrate.plan.restarts import AttemptResult, Next, Reachable
from orchestrate.probe.daemons import Local
from orchestrate.probe.observations import HostReport
from orchestrate.probe.platforms import require_same
from orchestrate.timings import Timings


@dataclass
class PreflightedHosts(Generic[NodesT]):
    """The hosts connected and past preflight: what every command that starts containers needs first."""

    scheduler: Scheduler[NodesT]  # what runs the containers on them, as the composition root (api.py) chose it
    nodes: NodesT  # the scheduler's connection to them, handed to every call
    hosts: Sequence[Host]  # those it holds, in node-rank order (a restart with --min-nodes: those kept)
    reports: list[HostReport]
    master: str
    local: Local  # this machine's image store, as the scheduler holds it (None: none here)
    local_id: str | None  # the image's ID here
    port: int | None  # node 0's master port, given or chosen by preflight (plan/ports.py)


def connect_and_preflight(scheduler: Scheduler[NodesT], config: UpConfig, attempt: Attempt, hosts: list[Host],
                          console: Console, timings: Timings,
                          history: Sequence[AttemptResult] = ()) -> PreflightedHosts[NodesT]:
    """Connect and preflight (the table; nothing starts unless it passes). `history`: how the attempts before this
    one ended (a restart's: with --min-nodes, which hosts it runs on is decided on it, plan/restarts.py)."""
    with timings.phase("connect"), ThreadPoolExecutor(1) as pool:
        local_lookup = pool.submit(_local_image, scheduler, config, console)  # the local daemon, while SSH handshakes run
        reached = _connect(scheduler, config, attempt, hosts, console, history)
        local, local_id = local_lookup.result()
    try:
        with timings.phase("preflight"):
            reached, reports, master = _preflight(scheduler, reached, config, attempt, local_id, console, history)
            if not config.delivery.pull:  # what is sent must run there (a pull picks the node's platform itself)
                _same_platform(scheduler, reached.nodes, reports, config.program.image, local)
    except BaseException:
        scheduler.close(reached.nodes)
        raise
    return PreflightedHosts(scheduler, reached.nodes, reached.hosts, reports, master, local, local_id, reports[0].port)


def _local_image(scheduler: Scheduler[NodesT], config: UpConfig, console: Console) -> tuple[Local, str | None]:
    """The image here, loaded first from what `submit` carried (--image-from) unless this is a dry run, which
    changes nothing."""
    if config.delivery.image_from is not None and not config.mode.dry_run_hosts:
        scheduler.load_carried(config.delivery.image_from, config.program.image, console)
    return scheduler.local_image(config.program.image)


def _same_platform(scheduler: Scheduler[NodesT], nodes: NodesT, reports: list[HostReport], image: str, local: Local) -> None:
    """Every node's daemon can run the local image (nothing to compare where there is none)."""
    platform = scheduler.local_platform(local, image)
    if platform is not None:
        found = scheduler.platforms(nodes, range(len(reports)))
        require_same(image, platform, [(r.label, p) for r, p in zip(reports, found, strict=True)])


def _connect(scheduler: Scheduler[NodesT], config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console,
             history: Sequence[AttemptResult]) -> Reached[NodesT]:
    """Every host, or (a restart with --min-nodes) every host that answers while enough do."""
    if not (attempt.number and config.resilience.min_nodes):
        return scheduler.connect(hosts, config.ssh, every=True)
    reached = scheduler.connect(hosts, config.ssh, every=False)
    for label, why in reached.unreachable.items():
        console.print(f"leaving out {label}: {why}", markup=False, highlight=False)
    return _keep(scheduler, reached, Reachable(tuple(reached.answered), len(reached.hosts), "reachable"), config, history)


def _keep(scheduler: Scheduler[NodesT], reached: Reached[NodesT], usable: Reachable, config: UpConfig,
          history: Sequence[AttemptResult]) -> Reached[NodesT]:
    """The hosts the restart runs on, as plan/restarts.py decides from the ones `usable`: all of them, fewer, or
    none (JobError: nothing starts); the scheduler narrows its connection to them."""
    decision = restarts.decide(config.program.job, history[:-1], history[-1], usable, config.resilience)
    if decision.next is Next.GIVE_UP:
        scheduler.close(reached.nodes)
        raise JobError(decision.why)
    if decision.next is not Next.SHRINK:
        return reached
    kept = [reached.hosts[i] for i in decision.keep]
    return Reached(scheduler.keep(reached.nodes, decision.keep), kept, range(len(kept)), {})


def _preflight(scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: UpConfig, attempt: Attempt,
               local_id: str | None, console: Console,
               history: Sequence[AttemptResult]) -> tuple[Reached[NodesT], list[HostReport], str]:
    """Preflight (all must pass), or on a restart with --min-nodes: hosts that fail are left out while enough
    remain, then the rest is checked again (node 0 and the master may have changed). --replace is the first
    start's only: a restart finds no job of its own running."""
    may_fail, replace = bool(attempt.number and config.resilience.min_nodes), config.resilience.replace and not attempt.number
    master = config.where.master_addr or scheduler.address(reached.nodes, 0)
    reports = run_preflight(scheduler, reached.nodes, reached.hosts, config, master, local_id, console, may_fail, replace)
    passed = [i for i, r in enumerate(reports) if not r.problems]
    if len(passed) == len(reports):
        return reached, reports, master
    for r in reports:
        if r.problems:
            console.print(f"leaving out {r.label}: " + "; ".join(r.problems), markup=False, highlight=False)
    reached = _keep(scheduler, reached, Reachable(tuple(passed), len(reports), "passed preflight"), config, history)
    master = config.where.master_addr or scheduler.address(reached.nodes, 0)
    reports = run_preflight(scheduler, reached.nodes, reached.hosts, config, master, local_id, console, replace=replace)
    return reached, reports, master
