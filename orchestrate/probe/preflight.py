"""Preflight: check every host in parallel, print one table, and refuse to start unless all pass."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrate.config import UpConfig, socket_exposure
from orchestrate.errors import MultiHostError, PreflightError, SSHError
from orchestrate.jobs import owner
from orchestrate.plan import gpus, gpuset, ports, transport
from orchestrate.plan.jobplan import host_dirs
from orchestrate.probe.holdings import Holdings, read_holdings
from orchestrate.remote import scripts
from orchestrate.remote.docker import client_over_ssh, image_id
from orchestrate.remote.ssh import Connection, Identity

# Every shell fact preflight needs, gathered in ONE exec per host (each exec costs a process spawn on the
# host, which is what limits fan-out on small machines); the values arrive as positional arguments.
PROBE_SCRIPT = scripts.text("probe.sh")


def probe_host(conn: Connection, config: UpConfig, rank: int, master_addr: str, master_ssh_port: int,
               dirs: dict[str, str]) -> dict[str, str]:
    """Run PROBE_SCRIPT once on the host (about the resolved `dirs`); return its facts."""
    argv = ["sh", "-c", PROBE_SCRIPT, "probe", dirs["data"], dirs["ckpt"], master_addr,
            "0" if rank == 0 else str(master_ssh_port), "1" if rank == 0 else "0", "1" if config.gpus else "0",
            dirs["log"]]
    sent = time.time()
    res = conn.run(argv, timeout=60)
    facts: dict[str, str] = {"sent": repr(sent), "answered": repr(time.time())}
    for record in res.out.split("\0"):
        key, sep, value = record.partition("=")
        if sep:
            facts[key.strip()] = value
    return facts


@dataclass
class Check:
    ok: bool
    text: str
    warn: bool = False  # passed, but worth a look (shown yellow)


@dataclass
class HostReport:
    """Everything preflight learned about one host; `problems` empty means it passed."""

    label: str
    checks: dict[str, Check] = field(default_factory=dict)
    iface: str | None = None
    addr: str | None = None  # this node's address toward the master: what its peers see it connect from
    gpus: int | None = None
    ib: bool | None = None  # an InfiniBand/RoCE port NCCL can use (None: not probed)
    image_id: str | None = None
    containers: list[Any] = field(default_factory=list)
    docker: Any = None
    identity: Identity | None = None  # the SSH login there: containers run as it, ~ in the dirs is its home
    dirs: dict[str, str] = field(default_factory=dict)  # the data/ckpt/log dirs, ~ resolved
    clock_skew: float = 0.0  # seconds the host's clock is ahead (+) or behind (-) this machine's, at least
    holdings: Holdings = field(default_factory=Holdings)  # what the containers on the daemon hold (labels)
    present: tuple[int, ...] = ()  # the device indices nvidia-smi lists
    gpu_set: tuple[int, ...] = ()  # the device indices this job gets here (empty: CPU, or refused)
    port: int | None = None  # node 0: the master port chosen or given (None: refused, or not node 0)
    listening: set[int] = field(default_factory=set)  # node 0: ports something listens on

    def add(self, name: str, ok: bool, text: str, warn: bool = False) -> None:
        self.checks[name] = Check(ok, text, warn)

    @property
    def problems(self) -> list[str]:
        return [f"{name}: {c.text}" for name, c in self.checks.items() if not c.ok]


COLUMNS = ("ssh", "docker", "gpus", "disk", "port", "master", "iface", "net", "image", "job")


def check_host(conn: Connection, rank: int, config: UpConfig, master_addr: str, master_ssh_port: int,
               local_image_id: str | None, replace: bool) -> HostReport:
    """Run every check on one host; a failed check is recorded, never raised, so the table shows them all."""
    report = HostReport(conn.host.label, identity=conn.identity())
    report.dirs = host_dirs(config, conn.host, report.identity.home)  # type: ignore[union-attr]
    report.add("ssh", True, f"{report.identity.name}@{conn.peer_address}")  # type: ignore[union-attr]
    try:
        report.docker = client_over_ssh(conn)
        report.add("docker", True, report.docker.server_version)
    except SSHError as err:
        report.add("docker", False, str(err).split(": ", 1)[-1])
        return report
    facts = probe_host(conn, config, rank, master_addr, master_ssh_port, report.dirs)
    report.clock_skew = clock_skew(facts)
    report.holdings = read_holdings(report.docker, config.job, report.identity.uid)  # type: ignore[union-attr]
    judge_gpus(facts, report, config, conn.host.slots)
    judge_transport(facts, report, config)
    exposed = socket_exposure(report.dirs, conn.host.docker_host)
    if exposed:
        report.add("disk", False, exposed)
    else:
        judge_disk(facts, report, config, report.dirs)
    replaced = _check_job(report, config.job, replace)
    if rank == 0:
        judge_port(facts, report, config.master_port, replaced)
    judge_master(facts, report, rank, master_addr, master_ssh_port, conn.host.iface)
    _check_image(report, config, local_image_id)
    return report


# torch's rendezvous (c10d keep-alives, the store's timeouts) compares timestamps across nodes; the order of
# failures does not depend on host clocks (watch/watcher.py, Watcher.exit_seen).
MAX_CLOCK_SKEW_S = 5.0


def clock_skew(facts: dict[str, str]) -> float:
    """PURE: how far the host's clock (`date` at the probe's start) lies outside the interval from sending the
    probe to its answer on this machine's clock: 0 when inside, so the SSH round trip is never taken for skew."""
    try:
        remote, sent, answered = float(facts["clock"]), float(facts["sent"]), float(facts["answered"])
    except (KeyError, ValueError):  # a `date` without %N support: no measurement, no warning
        return 0.0
    return remote - answered if remote > answered else remote - sent if remote < sent else 0.0


def clock_warnings(reports: Sequence[HostReport]) -> list[str]:
    """PURE: one warning per host whose clock is off by more than MAX_CLOCK_SKEW_S (the job may still run)."""
    return [f"warning: {r.label}'s clock is {abs(r.clock_skew):.0f} s {'ahead of' if r.clock_skew > 0 else 'behind'} "
            "this machine's; torch's rendezvous compares timestamps across nodes: sync the clocks (NTP, e.g. chrony)"
            for r in reports if abs(r.clock_skew) > MAX_CLOCK_SKEW_S]


def judge_gpus(facts: dict[str, str], report: HostReport, config: UpConfig, slots: int | None) -> None:
    """PURE: GPUs visible (nvidia-smi), and the set this job gets beside the other jobs' (gpuset.py); skipped
    with --gpus 0. Whether containers can use them (the runtime registered with the daemon, the driver new
    enough for the image's CUDA) is the GPU probe's fact, once the image is on the node (gpuprobe.py)."""
    if not config.gpus:
        report.add("gpus", True, "CPU mode")
        return
    smi = facts.get("smi", "missing")
    if smi == "missing":
        report.add("gpus", False, "nvidia-smi not found (no NVIDIA driver); install it, or use --gpus 0 for CPU")
        return
    if smi != "ok":
        report.add("gpus", False, f"nvidia-smi failed: {' '.join(smi.split())[:120]}")
        return
    count = int(facts.get("gpus") or 0)
    report.gpus = count
    need = max(config.gpus, slots or 0, 1)
    if count < need:
        report.add("gpus", False, f"{count} GPU(s) visible, {need} needed; lower --gpus or slots=")
        return
    absent = gpus.absent_indices(config.gpu_ids, facts.get("gpu_list", ""))
    if absent:
        report.add("gpus", False, absent)
        return
    present = report.present = tuple(gpus.gpu_indices(facts.get("gpu_list", "")))
    grant = gpuset.allocate(config.gpus, config.gpu_ids, present, report.holdings.others, report.holdings.own_gpus)
    if grant.problem:
        report.add("gpus", False, grant.problem)
        return
    report.gpu_set = grant.gpus
    busy = gpus.busy_warning(config.gpus, grant.gpus, facts.get("gpu_list", ""), facts.get("compute_apps", ""))
    text = f"GPU {gpus.gpus_text(grant.gpus)} of {count}"
    rest = gpuset.holders_of(present, report.holdings.others)
    report.add("gpus", True, text + (f"; others: {rest}" if rest else "") + (f"; {busy}" if busy else ""),
               warn=bool(busy))


def judge_transport(facts: dict[str, str], report: HostReport, config: UpConfig) -> None:
    """PURE: the InfiniBand/RoCE devices NCCL could use here; a forced `--nccl-transport ib` without them fails."""
    if config.cpu_mode:
        report.add("net", True, "sockets (gloo)")
        return
    rdma = transport.parse_rdma(facts.get("ib_devs", ""), facts.get("rdma_ports", ""))
    report.ib = rdma.usable
    problem = transport.forced_ib_problem(config.nccl_transport, rdma)
    if problem:
        report.add("net", False, problem)
    elif config.nccl_transport == "socket":
        report.add("net", True, "sockets (--nccl-transport socket)")
    else:
        report.add("net", True, rdma.describe())


def settle_transport(reports: Sequence[HostReport], config: UpConfig) -> None:
    """PURE: with `auto`, one node without IB puts every node on sockets (NCCL needs one network on all ranks):
    the IB nodes' cells say so."""
    if config.nccl_transport != "auto" or transport.job_transport("auto", [r.ib for r in reports]) != "socket":
        return
    for r in reports:
        if r.ib and "net" in r.checks:
            r.add("net", True, f"sockets ({r.checks['net'].text} idle: not every node has IB)", warn=True)


def judge_disk(facts: dict[str, str], report: HostReport, config: UpConfig, dirs: dict[str, str]) -> None:
    """PURE: the data, checkpoint and log dirs belong to no other account, can be created, are writable, and
    (data, checkpoints) have the free space asked for."""
    texts = []
    for kind in ("data", "ckpt", "log"):
        path, base = dirs[kind], facts.get(f"{kind}_base", "?")
        if facts.get(f"{kind}_foreign"):
            report.add("disk", False, f"{kind} dir {path}: {facts[f'{kind}_foreign']} belongs to another account, "
                                      "which could replace what the job reads or writes; choose a dir of your own "
                                      "or have that folder removed")
            return
        if facts.get(f"{kind}_isdir") != "1":
            report.add("disk", False, f"{kind} dir {path} cannot be created: {base} is not a directory; "
                                      "choose another dir")
            return
        if facts.get(f"{kind}_writable") != "1":
            report.add("disk", False, f"{kind} dir {path} not writable ({base}); choose another dir or fix permissions")
            return
        if kind == "log":
            continue
        try:
            free_gb = int(facts.get(f"{kind}_free_kb", "")) / 1024**2
        except ValueError:
            report.add("disk", False, f"cannot read free space under {base} (df failed)")
            return
        if free_gb < config.min_free_gb:
            report.add("disk", False, f"{kind} dir {path}: {free_gb:.1f} GB free, {config.min_free_gb:.10g} GB "
                                      "needed; free space or choose another dir")
            return
        texts.append(f"{kind} {free_gb:.0f}G")
    report.add("disk", True, " ".join(texts))


def judge_port(facts: dict[str, str], report: HostReport, port: int | None, replaced: bool = False) -> None:
    """PURE: node 0's master port (ports.py): the one given, or one free there and claimed by no other job's
    label. A given port the job that `--replace` removes first listens on is not taken (its torchrun holds it)."""
    if facts.get("ss_ok") != "1":
        report.add("port", False, "cannot list listening ports (ss from iproute2 missing?)")
        return
    report.listening = ports.listening_ports(facts.get("listening", ""))
    report.port, text = ports.choose(port, report.listening, report.holdings.others, report.holdings.own_port,
                                     replaced)
    report.add("port", report.port is not None, text)


def judge_master(facts: dict[str, str], report: HostReport, rank: int, addr: str, ssh_port: int,
                 iface: str | None) -> None:
    """PURE: the interface carrying the master address, and whether the address answers from this node.

    A node that holds the address uses the interface that has it (`ip route get` would say lo, which
    breaks gloo); the others use the route's device.
    """
    held = facts.get("held", "").split("@")[0]
    match = re.search(r"\bdev (\S+)", facts.get("route", ""))
    report.iface = iface or held or (match.group(1) if match else None)
    src = re.search(r"\bsrc (\S+)", facts.get("route", ""))
    report.addr = addr if held else src.group(1) if src else None
    if held:
        report.add("master", True, f"{addr} is local")
    elif not match:
        report.add("master", False, f"no route to master address {addr}; check --master-addr and the network")
        return
    elif rank != 0 and facts.get("probe") != "1":
        report.add("master", False, f"master address {addr} not reachable from this node (no TCP answer on "
                                    f"port {ssh_port}); check --master-addr and firewalls")
        return
    else:
        report.add("master", True, f"{addr} reachable")
    if report.iface == "lo" and not addr.startswith("127."):
        report.add("iface", False, "interface resolved to lo; set iface= for this host in the hosts file")
    else:
        report.add("iface", True, report.iface or "?")


def _check_image(report: HostReport, config: UpConfig, local_id: str | None) -> None:
    report.image_id = image_id(report.docker, config.image)
    if report.image_id is not None:
        same = local_id is None or report.image_id == local_id
        report.add("image", True, "present" if same else "present, differs from local: will be replaced")
    elif config.pull:
        report.add("image", True, "will be pulled")
    elif local_id is not None:
        report.add("image", True, "will be sent")
    else:
        report.add("image", False, f"{config.image} missing here and on this machine; build it (make image), "
                                   "or pass --pull to pull it on the nodes")


def _check_job(report: HostReport, job: str, replace: bool) -> bool:
    """Whether the job runs here and --replace (the first attempt's only) will remove it before the start."""
    assert report.identity is not None  # set when the report is made
    report.containers = owner.mine(report.docker, job, report.identity.uid)
    running = [c.name for c in report.containers if c.status in ("running", "restarting", "created")]
    if running and not replace:
        report.add("job", False, f"job {job!r} already running here ({', '.join(running)}); "
                                 f"use --replace, or 'kill --job {job}'")
    else:
        report.add("job", True, "replace" if running else "free")
    return bool(running and replace)


def run_preflight(conns: Sequence[Connection], config: UpConfig, master_addr: str, local_image_id: str | None,
                  console: Console, may_fail: bool = False, replace: bool = False) -> list[HostReport]:
    """Check all hosts in parallel; print the table; raise PreflightError (one line per host) on any failure,
    unless `may_fail` (a restart that may leave failing hosts out: the caller decides). `replace`: a running
    job of the same name passes (it is removed before the start)."""
    from orchestrate.remote.ssh import fan_out

    master_port = conns[0].host.port
    reports: list[HostReport] = []
    try:
        reports = fan_out("preflight", list(enumerate(conns)),
                          lambda rc: check_host(rc[1], rc[0], config, master_addr, master_port, local_image_id,
                                                replace),
                          lambda rc: rc[1].host.label)
    except MultiHostError as err:
        raise PreflightError("preflight could not run on every host; nothing was started:\n  "
                             + "\n  ".join(err.lines())) from None
    settle_transport(reports, config)
    console.print(render_table(reports))
    for line in clock_warnings(reports):
        console.print(line, markup=False)
    failed = [r for r in reports if r.problems]
    if failed and not may_fail:
        lines = [f"{r.label}: " + "; ".join(r.problems) for r in failed]
        raise PreflightError("preflight failed, nothing was started:\n  " + "\n  ".join(lines))
    return reports


def render_table(reports: Sequence[HostReport]) -> Table:
    table = Table(title="preflight")
    table.add_column("node")
    table.add_column("host")
    for col in COLUMNS:
        table.add_column(col)
    for rank, report in enumerate(reports):
        cells = []
        for col in COLUMNS:
            check = report.checks.get(col)
            color = "red" if check is None or not check.ok else "yellow" if check.warn else "green"
            cells.append("-" if check is None else f"[{color}]{escape(check.text)}[/]")
        table.add_row(str(rank), report.label, *cells)
    return table
