"""Preflight: check every host in parallel, print one table, and refuse to start unless all pass. The probe
observes (through the backend's Daemons.probe_host; the clock rules and the table: probe/preflight.py), the plan
judges (plan/verdicts.py); this composes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace as replace_field

from rich.console import Console

from orchestrate.backends.protocol import NodesT
from orchestrate.config import UpConfig
from orchestrate.errors import MultiHostError, PreflightError, SSHError
from orchestrate.hostdirs import socket_exposure
from orchestrate.hosts import Host
from orchestrate.plan.gpuset import decide_gpus
from orchestrate.plan.jobplan import host_dirs
from orchestrate.plan.ports import listening_ports
from orchestrate.plan.verdicts import (
    Network,
    judge_disk,
    judge_gpus,
    judge_image,
    judge_job,
    judge_master,
    judge_port,
    judge_transport,
    settle_transport,
)
from orchestrate.probe.daemons import Daemons
from orchestrate.probe.observations import Check, GpuSeen, HostReport, gpu_seen
from orchestrate.probe.preflight import clock_skew, clock_warnings, render_table


def check_host(daemons: Daemons[NodesT], nodes: NodesT, host: Host, rank: int, config: UpConfig, master_addr: str,
               master_ssh_port: int, local_image_id: str | None, replace: bool) -> HostReport:
    """Observe one host (`host`, node `rank` of `nodes`), then judge it: every check runs, a failed one is
    recorded, never raised, so the table shows them all."""
    identity = daemons.identity(nodes, rank)
    dirs = host_dirs(config.where, config.program.job, host, identity.home)
    ssh = Check(True, f"{identity.name}@{daemons.address(nodes, rank)}")
    try:
        version = daemons.daemon_version(nodes, rank)
    except SSHError as err:
        return HostReport(host.label, {"ssh": ssh, "docker": Check(False, str(err).split(": ", 1)[-1])},
                          identity=identity, dirs=dirs)
    probed = daemons.probe_host(nodes, rank, config.resources, master_addr, master_ssh_port, dirs)
    holdings = daemons.holdings(nodes, rank, config.program.job, identity.uid)
    containers = tuple(daemons.job_containers(nodes, rank, config.program.job, identity.uid))
    image_id = daemons.image_id(nodes, rank, config.program.image)
    gpu = (gpu_seen(probed) or GpuSeen("missing")) if config.resources.gpus else None  # asked only for GPUs
    checks = {"ssh": ssh, "docker": Check(True, version),
              "gpus": judge_gpus(decide_gpus(config.resources, host, gpu, holdings))}
    net = judge_transport(probed, config.resources)
    checks["net"] = net.check
    exposed = socket_exposure(dirs, host.docker_host)
    checks["disk"] = Check(False, exposed) if exposed else judge_disk(probed, config.resources, dirs)
    replaced, checks["job"] = judge_job(containers, config.program.job, replace)
    port = judge_port(probed, holdings, config.where.master_port, replaced) if rank == 0 else None
    if port is not None:
        checks["port"] = port.check
    master = judge_master(probed, rank, master_addr, master_ssh_port, host.iface)
    checks.update(master.checks)
    checks["image"] = judge_image(image_id, config.delivery, config.program, local_image_id)
    return HostReport(host.label, checks, master.iface, master.addr, gpu, net.ib, image_id, containers, identity,
                      dirs, clock_skew(probed), holdings, port.port if port is not None else None,
                      frozenset(listening_ports(probed.get("listening", ""))) if rank == 0 else frozenset())


def _transport_settled(reports: list[HostReport], config: UpConfig) -> list[HostReport]:
    """The reports with each `net` cell as the whole job's transport leaves it (plan/verdicts.py's settle_transport;
    a host whose daemon did not answer has no cell, and no InfiniBand known)."""
    nets = settle_transport([Network(r.ib, r.checks.get("net", Check(True, ""))) for r in reports], config.resources)
    return [replace_field(r, checks={**r.checks, "net": n.check}) if "net" in r.checks else r
            for r, n in zip(reports, nets, strict=True)]


def run_preflight(daemons: Daemons[NodesT], nodes: NodesT, hosts: Sequence[Host], config: UpConfig, master_addr: str,
                  local_image_id: str | None, console: Console, may_fail: bool = False,
                  replace: bool = False) -> list[HostReport]:
    """Check all hosts (`hosts`, those `nodes` holds, node-rank order) in parallel; print the table; raise
    PreflightError (one line per host) on any failure, unless `may_fail` (a restart that may leave failing hosts
    out: the caller decides). `replace`: a running job of the same name passes (it is removed before the start)."""
    from orchestrate.fanout import fan_out

    master_port = hosts[0].port
    reports: list[HostReport] = []
    try:
        reports = fan_out("preflight", list(range(len(hosts))),
                          lambda r: check_host(daemons, nodes, hosts[r], r, config, master_addr, master_port,
                                               local_image_id, replace),
                          lambda r: hosts[r].label)
    except MultiHostError as err:
        raise PreflightError("preflight could not run on every host; nothing was started:\n  "
                             + "\n  ".join(err.lines())) from None
    reports = _transport_settled(reports, config)
    console.print(render_table(reports))
    for line in clock_warnings(reports):
        console.print(line, markup=False)
    failed = [r for r in reports if r.problems]
    if failed and not may_fail:
        lines = [f"{r.label}: " + "; ".join(r.problems) for r in failed]
        raise PreflightError("preflight failed, nothing was started:\n  " + "\n  ".join(lines))
    return reports
