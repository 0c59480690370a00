"""Connect and preflight: the hosts connected and past preflight, what every command that starts containers needs
first; on a restart with --min-nodes, the hosts that do not answer or fail preflight are left out while enough
remain."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console

from orchestrate.config import UpConfig
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt
from orchestrate.probe.facts import local_image
from orchestrate.probe.platforms import local_platform, require_same
from orchestrate.probe.preflight import HostReport, run_preflight
from orchestrate.remote.session import Nodes
from orchestrate.timings import Timings

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient


@dataclass
class Ready:
    """The hosts connected and past preflight: what every command that starts containers needs first."""

    nodes: Nodes
    reports: list[HostReport]
    master: str
    local: DockerClient | None  # the local Docker client (None: no local daemon)
    local_id: str | None  # the image's ID here
    port: int | None  # node 0's master port, given or chosen by preflight (plan/ports.py)


def connect_and_preflight(config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console,
                          timings: Timings) -> Ready:
    """Connect and preflight (the table; nothing starts unless it passes)."""
    with timings.phase("connect"), ThreadPoolExecutor(1) as pool:
        local_lookup = pool.submit(local_image, config.image)  # the local daemon, while SSH handshakes run
        nodes = _connect(config, attempt, hosts, console)
        local, local_id = local_lookup.result()
    try:
        with timings.phase("preflight"):
            nodes, reports, master = _preflight(nodes, config, attempt, local_id, console)
            if not config.pull:  # what is sent must run there (a pull picks the node's platform itself)
                require_same(config.image, local_platform(local, config.image), [(r.label, r.docker) for r in reports])
    except BaseException:
        nodes.close()
        raise
    for rank, report in enumerate(reports):
        nodes.adopt_docker(rank, report.docker)
    return Ready(nodes, reports, master, local, local_id, reports[0].port)


def _connect(config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console) -> Nodes:
    """Every host, or (a restart with --min-nodes) every host that answers while enough do."""
    if not (attempt.number and config.min_nodes):
        return Nodes.connect(hosts, config.ssh.accept_new_host_keys)
    nodes, unreachable = Nodes.connect_reachable(hosts, config.ssh.accept_new_host_keys)
    for label, why in unreachable.items():
        console.print(f"leaving out {label}: {why}", markup=False, highlight=False)
    return _keep(nodes, nodes.reachable(), config, attempt, "reachable")


def _keep(nodes: Nodes, keep: list[int], config: UpConfig, attempt: Attempt, what: str) -> Nodes:
    assert config.min_nodes is not None
    if len(keep) < config.min_nodes:
        nodes.close()
        raise JobError(f"restart {attempt.number}: only {len(keep)} host(s) {what}, fewer than --min-nodes "
                       f"{config.min_nodes}; the job was stopped on all nodes; fix the hosts, then 'up --resume'")
    if len(keep) == len(nodes.hosts):
        return nodes
    for i, conn in enumerate(nodes.conns):
        if i not in keep and conn is not None:
            conn.close()
    return Nodes([nodes.hosts[i] for i in keep], [nodes.conns[i] for i in keep])


def _preflight(nodes: Nodes, config: UpConfig, attempt: Attempt, local_id: str | None,
               console: Console) -> tuple[Nodes, list[HostReport], str]:
    """Preflight (all must pass), or on a restart with --min-nodes: hosts that fail are left out while enough
    remain, then the rest is checked again (node 0 and the master may have changed). --replace is the first
    start's only: a restart finds no job of its own running."""
    may_fail, replace = bool(attempt.number and config.min_nodes), config.replace and not attempt.number
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.connected(), config, master, local_id, console, may_fail, replace)
    passed = [i for i, r in enumerate(reports) if not r.problems]
    if len(passed) == len(reports):
        return nodes, reports, master
    for r in reports:
        if r.problems:
            console.print(f"leaving out {r.label}: " + "; ".join(r.problems), markup=False, highlight=False)
    nodes = _keep(nodes, passed, config, attempt, "passed preflight")
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.connected(), config, master, local_id, console, replace=replace)
    return nodes, reports, master

