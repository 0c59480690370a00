"""Preflight: check every host in parallel, print one table, and refuse to start unless all pass. The probe
observes (probe/preflight.py), the plan judges (plan/verdicts.py); this composes them."""

from __future__ import annotations

from rich.console import Console

from orchestrate.backends import backend
from orchestrate.config import UpConfig, socket_exposure
from orchestrate.errors import MultiHostError, PreflightError, SSHError
from orchestrate.plan.gpus import granted_here
from orchestrate.plan.jobplan import host_dirs
from orchestrate.plan.verdicts import (
    judge_disk,
    judge_gpus,
    judge_image,
    judge_job,
    judge_master,
    judge_port,
    judge_transport,
    settle_transport,
)
from orchestrate.probe.observations import HostReport
from orchestrate.probe.preflight import clock_skew, clock_warnings, probe_host, render_table
from orchestrate.remote.session import Session


def check_host(nodes: Session, rank: int, config: UpConfig, master_addr: str, master_ssh_port: int,
               local_image_id: str | None, replace: bool) -> HostReport:
    """Run every check on one host; a failed check is recorded, never raised, so the table shows them all."""
    conn, daemons = nodes.conn(rank), backend()
    report = HostReport(conn.host.label, identity=conn.identity())
    report.dirs = host_dirs(config.where, config.program.job, conn.host, report.identity.home)  # type: ignore[union-attr]
    report.add("ssh", True, f"{report.identity.name}@{conn.peer_address}")  # type: ignore[union-attr]
    try:
        report.add("docker", True, daemons.daemon_version(nodes, rank))
    except SSHError as err:
        report.add("docker", False, str(err).split(": ", 1)[-1])
        return report
    facts = probe_host(conn, config.resources, rank, master_addr, master_ssh_port, report.dirs)
    report.clock_skew = clock_skew(facts)
    report.holdings = daemons.holdings(nodes, rank, config.program.job, report.identity.uid)  # type: ignore[union-attr]
    report.containers = daemons.job_containers(nodes, rank, config.program.job, report.identity.uid)  # type: ignore[union-attr]
    report.image_id = daemons.image_id(nodes, rank, config.program.image)
    judge_gpus(facts, report, granted_here(config.resources, conn.host), conn.host.slots)
    judge_transport(facts, report, config.resources)
    exposed = socket_exposure(report.dirs, conn.host.docker_host)
    if exposed:
        report.add("disk", False, exposed)
    else:
        judge_disk(facts, report, config.resources, report.dirs)
    replaced = judge_job(report, config.program.job, replace)
    if rank == 0:
        judge_port(facts, report, config.where.master_port, replaced)
    judge_master(facts, report, rank, master_addr, master_ssh_port, conn.host.iface)
    judge_image(report, config.delivery, config.program, local_image_id)
    return report


def run_preflight(nodes: Session, config: UpConfig, master_addr: str, local_image_id: str | None,
                  console: Console, may_fail: bool = False, replace: bool = False) -> list[HostReport]:
    """Check all hosts in parallel; print the table; raise PreflightError (one line per host) on any failure,
    unless `may_fail` (a restart that may leave failing hosts out: the caller decides). `replace`: a running
    job of the same name passes (it is removed before the start)."""
    from orchestrate.remote.ssh import fan_out

    master_port = nodes.connected()[0].host.port
    reports: list[HostReport] = []
    try:
        reports = fan_out("preflight", list(range(len(nodes.hosts))),
                          lambda r: check_host(nodes, r, config, master_addr, master_port, local_image_id, replace),
                          lambda r: nodes.hosts[r].label)
    except MultiHostError as err:
        raise PreflightError("preflight could not run on every host; nothing was started:\n  "
                             + "\n  ".join(err.lines())) from None
    settle_transport(reports, config.resources)
    console.print(render_table(reports))
    for line in clock_warnings(reports):
        console.print(line, markup=False)
    failed = [r for r in reports if r.problems]
    if failed and not may_fail:
        lines = [f"{r.label}: " + "; ".join(r.problems) for r in failed]
        raise PreflightError("preflight failed, nothing was started:\n  " + "\n  ".join(lines))
    return reports
