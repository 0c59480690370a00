"""Preflight: check every host in parallel, print one table, and refuse to start unless all pass."""

from __future__ import annotations

import posixpath
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .config import UpConfig
from .docker import client_over_ssh, image_id, job_containers
from .errors import MultiHostError, PreflightError, SSHError
from .plan import host_dirs
from .ssh import Connection

NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
# A fixed script (no interpolation): the address and port arrive as positional arguments $0 and $1.
TCP_PROBE = ["timeout", "5", "bash", "-c", 'exec 3<>"/dev/tcp/$0/$1"']


@dataclass
class Check:
    ok: bool
    text: str


@dataclass
class HostReport:
    """Everything preflight learned about one host; `problems` empty means it passed."""

    label: str
    checks: dict[str, Check] = field(default_factory=dict)
    iface: str | None = None
    gpus: int | None = None
    image_id: str | None = None
    containers: list[Any] = field(default_factory=list)
    docker: Any = None

    def add(self, name: str, ok: bool, text: str) -> None:
        self.checks[name] = Check(ok, text)

    @property
    def problems(self) -> list[str]:
        return [f"{name}: {c.text}" for name, c in self.checks.items() if not c.ok]


COLUMNS = ("ssh", "docker", "gpus", "disk", "port", "master", "iface", "image", "job")


def check_host(conn: Connection, rank: int, config: UpConfig, master_addr: str, master_ssh_port: int,
               local_image_id: str | None) -> HostReport:
    """Run every check on one host; a failed check is recorded, never raised, so the table shows them all."""
    report = HostReport(conn.host.label)
    report.add("ssh", True, f"{conn.host.user or ''}@{conn.peer_address}".lstrip("@"))
    try:
        report.docker = client_over_ssh(conn)
        version = report.docker.version()
        report.add("docker", True, f"{version.get('Version', '?')}")
    except SSHError as err:
        report.add("docker", False, str(err).split(": ", 1)[-1])
        return report
    _check_gpus(conn, report, config)
    _check_disk(conn, report, config)
    if rank == 0:
        _check_port(conn, report, config.master_port)
    _check_master(conn, report, rank, master_addr, master_ssh_port)
    _check_image(report, config, local_image_id)
    _check_job(report, config)
    return report


def _check_gpus(conn: Connection, report: HostReport, config: UpConfig) -> None:
    if config.cpu_mode:
        report.add("gpus", True, "CPU mode")
        return
    res = conn.run(NVIDIA_SMI, timeout=30)
    if res.rc == 127:
        report.add("gpus", False, "nvidia-smi not found (no NVIDIA driver); install it, or use --gpus 0 for CPU")
        return
    if res.rc != 0:
        report.add("gpus", False, f"nvidia-smi failed: {(res.err or res.out).strip()[:120]}")
        return
    count = len([line for line in res.out.splitlines() if line.strip()])
    report.gpus = count
    need = max(config.gpus, conn.host.slots or 0, 1)
    if count < need:
        report.add("gpus", False, f"{count} GPU(s) visible, {need} needed; lower --gpus or slots=")
        return
    runtimes = report.docker.info().get("Runtimes", {})
    hook = conn.run(["sh", "-c", "command -v nvidia-container-runtime-hook || command -v nvidia-ctk"], timeout=20)
    if "nvidia" not in runtimes and hook.rc != 0:
        report.add("gpus", False, f"{count} GPU(s) but no NVIDIA container runtime; install nvidia-container-toolkit")
        return
    report.add("gpus", True, f"{count} GPU(s)")


def _existing_ancestor(conn: Connection, path: str) -> tuple[str, bool]:
    """The deepest existing part of `path`, and whether it is a directory."""
    sftp = conn.sftp()
    while True:
        try:
            return path, stat.S_ISDIR(sftp.stat(path).st_mode or 0)
        except OSError:
            parent = posixpath.dirname(path)
            if parent == path:
                return "/", True
            path = parent


def _check_disk(conn: Connection, report: HostReport, config: UpConfig) -> None:
    texts = []
    for kind, path in host_dirs(config, conn.host).items():
        if kind == "log":
            continue
        base, is_dir = _existing_ancestor(conn, path)
        if not is_dir:
            report.add("disk", False, f"{kind} dir {path} cannot be created: {base} is not a directory; "
                                      "choose another dir")
            return
        if conn.run(["test", "-w", base], timeout=20).rc != 0:
            report.add("disk", False, f"{kind} dir {path} not writable ({base}); choose another dir or fix permissions")
            return
        res = conn.run(["df", "-Pk", base], timeout=20)
        try:
            free_gb = int(res.out.splitlines()[-1].split()[3]) / 1024**2
        except (IndexError, ValueError):
            report.add("disk", False, f"cannot read free space under {base}: {res.err.strip()[:80]}")
            return
        if free_gb < config.min_free_gb:
            report.add("disk", False, f"{kind} dir {path}: {free_gb:.1f} GB free, {config.min_free_gb:.10g} GB needed; "
                                      "free space or choose another dir")
            return
        texts.append(f"{kind} {free_gb:.0f}G")
    report.add("disk", True, " ".join(texts))


def _check_port(conn: Connection, report: HostReport, port: int) -> None:
    res = conn.run(["ss", "-Htln"], timeout=20)
    if res.rc != 0:
        report.add("port", False, "cannot list listening ports (ss from iproute2 missing?)")
        return
    used = {line.split()[3].rsplit(":", 1)[-1] for line in res.out.splitlines() if len(line.split()) > 3}
    if str(port) in used:
        report.add("port", False, f"master port {port} already in use on node 0; pick another with --master-port")
    else:
        report.add("port", True, f"{port} free")


def _check_master(conn: Connection, report: HostReport, rank: int, addr: str, ssh_port: int) -> None:
    """Find the interface carrying the master address, and check that the address answers from here."""
    if conn.host.iface:
        report.iface = conn.host.iface
    held = conn.run(["ip", "-o", "addr", "show", "to", addr], timeout=20)
    if held.rc == 0 and held.out.strip():
        # This node holds the address: use the interface that has it (`ip route get` would say lo).
        report.iface = report.iface or held.out.split()[1].split("@")[0]
        report.add("master", True, f"{addr} is local")
    else:
        route = conn.run(["ip", "-o", "route", "get", addr], timeout=20)
        match = re.search(r"\bdev (\S+)", route.out)
        if route.rc != 0 or not match:
            report.add("master", False, f"no route to master address {addr}; check --master-addr and the network")
            return
        report.iface = report.iface or match.group(1)
        probe = conn.run([*TCP_PROBE, addr, str(ssh_port)], timeout=20)
        if probe.rc != 0:
            report.add("master", False, f"master address {addr} not reachable from this node (no TCP answer on "
                                        f"port {ssh_port}); check --master-addr and firewalls")
            return
        report.add("master", True, f"{addr} reachable")
    if report.iface == "lo" and rank == 0 and not addr.startswith("127."):
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


def _check_job(report: HostReport, config: UpConfig) -> None:
    report.containers = job_containers(report.docker, config.job)
    running = [c.name for c in report.containers if c.status in ("running", "restarting", "created")]
    if running and not config.replace:
        report.add("job", False, f"job {config.job!r} already running here ({', '.join(running)}); "
                                 f"use --replace, or 'kill --job {config.job}'")
    else:
        report.add("job", True, "replace" if running else "free")


def run_preflight(conns: Sequence[Connection], config: UpConfig, master_addr: str, local_image_id: str | None,
                  console: Console) -> list[HostReport]:
    """Check all hosts in parallel; print the table; raise PreflightError (one line per host) on any failure."""
    from .ssh import fan_out

    master_port = conns[0].host.port
    reports: list[HostReport] = []
    try:
        reports = fan_out("preflight", list(enumerate(conns)),
                          lambda rc: check_host(rc[1], rc[0], config, master_addr, master_port, local_image_id),
                          lambda rc: rc[1].host.label)
    except MultiHostError as err:
        raise PreflightError("preflight could not run on every host; nothing was started:\n  "
                             + "\n  ".join(err.lines())) from None
    console.print(render_table(reports))
    failed = [r for r in reports if r.problems]
    if failed:
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
            cells.append("-" if check is None else f"[{'green' if check.ok else 'red'}]{escape(check.text)}[/]")
        table.add_row(str(rank), report.label, *cells)
    return table
