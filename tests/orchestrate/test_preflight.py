"""Preflight judgements are pure functions of the facts one probe gathers on a host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kit.probe import probe_facts
from kit.units import SSH, gpus_judged

from orchestrate.config import UpConfig
from orchestrate.plan.verdicts import judge_disk, judge_master, judge_port
from orchestrate.probe.observations import Check, Holdings, HostReport, gpu_seen
from orchestrate.probe.preflight import clock_skew, clock_warnings

DIRS = {"data": "/d", "ckpt": "/c/j", "log": "/l"}
DISK_OK = {"data_base": "/", "data_isdir": "1", "data_writable": "1", "data_free_kb": str(50 * 1024**2),
           "ckpt_base": "/", "ckpt_isdir": "1", "ckpt_writable": "1", "ckpt_free_kb": str(50 * 1024**2),
           "log_base": "/", "log_isdir": "1", "log_writable": "1"}


def problems(name: str, cell: Check) -> list[str]:
    return [] if cell.ok else [f"{name}: {cell.text}"]


def test_gpus_too_few_missing_and_ok() -> None:
    _, cell = gpus_judged({"smi": "ok", "gpus": "2"}, UpConfig.of(ssh=SSH, gpus=4).resources)
    assert problems("gpus", cell) == ["gpus: 2 GPU(s) visible, 4 needed; lower --gpus or slots="]
    _, cell = gpus_judged({"smi": "missing"}, UpConfig.of(ssh=SSH, gpus=1).resources)
    assert "nvidia-smi not found" in cell.text and not cell.ok
    _, cell = gpus_judged({"smi": "ok", "gpus": "8"}, UpConfig.of(ssh=SSH).resources, slots=8)
    assert cell.ok and HostReport("h0", gpu=gpu_seen({"smi": "ok", "gpus": "8"})).gpus == 8
    _, cell = gpus_judged({}, UpConfig.of(ssh=SSH, gpus=0).resources)
    assert cell.text == "CPU mode" and cell.ok


def test_disk() -> None:
    cell = judge_disk(DISK_OK, UpConfig.of(ssh=SSH, gpus=0).resources, DIRS)
    assert cell.ok and cell.text == "data 50G ckpt 50G"
    cell = judge_disk(DISK_OK | {"ckpt_free_kb": "1024"}, UpConfig.of(ssh=SSH, gpus=0).resources, DIRS)
    assert problems("disk", cell) == ["disk: ckpt dir /c/j: 0.0 GB free, 1 GB needed; free space or choose another dir"]
    cell = judge_disk(DISK_OK | {"data_writable": "0", "data_base": "/ro"}, UpConfig.of(ssh=SSH, gpus=0).resources, DIRS)
    assert "data dir /d not writable (/ro)" in cell.text and not cell.ok
    # A folder of the chain that another account owns (e.g. made first in a world-writable /var/tmp) is refused.
    cell = judge_disk(DISK_OK | {"log_foreign": "/var/tmp/ddp-cifar (owned by mallory)"},
                      UpConfig.of(ssh=SSH, gpus=0).resources, DIRS)
    assert problems("disk", cell) == ["disk: log dir /l: /var/tmp/ddp-cifar (owned by mallory) belongs to another "
                                      "account, which could replace what the job reads or writes; choose a dir of "
                                      "your own or have that folder removed"]


def test_port_and_master() -> None:
    port = judge_port({"ss_ok": "1", "listening": "0.0.0.0:22 [::]:29500 "}, Holdings(), 29500)
    assert "already in use on node 0" in port.check.text and not port.check.ok and port.port is None
    # up --replace on a running job: its own torchrun holds the port, and goes first
    port = judge_port({"ss_ok": "1", "listening": "0.0.0.0:22 [::]:29500 "}, Holdings(), 29500, replaced=True)
    assert port.check.ok and port.port == 29500
    assert judge_port({"ss_ok": "1", "listening": "0.0.0.0:22 127.0.0.1:295000"}, Holdings(), 29500).check.ok
    # Node 0 holds the address: the interface that has it, never lo from `ip route get`.
    m = judge_master({"held": "eth0@if12", "route": "local 10.0.0.2 dev lo src 10.0.0.2"}, 0, "10.0.0.2", 22, None)
    assert m.iface == "eth0" and m.addr == "10.0.0.2" and all(c.ok for _, c in m.checks)
    m = judge_master({"route": "10.0.0.2 dev ib0 src 10.0.0.3", "probe": "1"}, 1, "10.0.0.2", 22, None)
    assert m.iface == "ib0" and m.addr == "10.0.0.3" and [n for n, c in m.checks if c.ok] == ["master", "iface"]
    m = judge_master({"route": "10.0.0.2 dev ib0 src 10.0.0.3", "probe": "0"}, 1, "10.0.0.2", 22, None)
    assert [n for n, _ in m.checks] == ["master"] and "not reachable from this node" in m.checks[0][1].text
    m = judge_master({"route": "10.0.0.2 dev ib0 src 10.0.0.3", "probe": "1"}, 1, "10.0.0.2", 22, "eth5")
    assert m.iface == "eth5"  # the hosts file's iface= wins


def test_probe_script_runs_locally_and_quotes_nothing_into_code(tmp_path: Path) -> None:
    marker = tmp_path / "owned"
    evil = str(tmp_path / f"x $(touch {marker}); `touch {marker}`")
    facts = probe_facts(evil, str(tmp_path), evil)
    assert facts["data_base"] == str(tmp_path) and facts["data_isdir"] == "1" and int(facts["ckpt_free_kb"]) > 0
    assert not marker.exists()
    assert "data_foreign" not in facts and "log_foreign" not in facts  # tmp_path is ours, / is root's


def test_the_preflight_table_fits_80_and_120_columns() -> None:
    import io

    from rich.console import Console

    from orchestrate.probe.preflight import COLUMNS, render_table

    reports = []
    for i in range(3):
        reports.append(HostReport(f"gpu-node-{i}.cluster.example.org", {
            col: Check(True, f"{col} fine: a fairly long explanation of the check on this host {i}") for col in COLUMNS}))
    for width in (80, 120):
        out = io.StringIO()
        Console(file=out, width=width).print(render_table(reports))
        assert max(len(line) for line in out.getvalue().splitlines()) <= width


def test_a_dir_holding_the_docker_socket_is_refused() -> None:
    """A rootless daemon's socket in the home (docker_host=) must not reach the containers through ~."""
    from orchestrate.hostdirs import socket_exposure

    home_sock = "unix:///home/u/.docker/run/docker.sock"
    problem = socket_exposure({"data": "/home/u/data", "ckpt": "/home/u", "log": "/home/u/logs"}, home_sock)
    assert problem is not None and problem.startswith("ckpt dir /home/u holds the Docker socket")
    assert socket_exposure({"ckpt": "/home/u/.docker/run"}, home_sock) is not None
    assert socket_exposure({"ckpt": "/home/u/ck", "data": "/home/u/.docker/other"}, home_sock) is None
    assert socket_exposure({"ckpt": "/var/run"}, None) is not None  # the default socket's folder
    assert socket_exposure({"ckpt": "/home/u/ck"}, "ssh://elsewhere") is None


def test_a_host_clock_is_measured_against_this_machine_outside_the_round_trip() -> None:
    sent, answered = 1000.0, 1000.4  # the probe's round trip, on this machine's clock

    def skew(clock: str) -> float:
        return clock_skew({"clock": clock, "sent": repr(sent), "answered": repr(answered)})

    assert skew("1000.2") == 0.0  # within the round trip: no skew that can be told apart from the trip
    assert skew("1030.4") == pytest.approx(30.0) and skew("900.0") == pytest.approx(-100.0)
    assert skew("1700000000.N") == 0.0  # a `date` without %N: not measured, never a false warning


def test_a_skewed_host_clock_is_warned_about_and_nothing_else() -> None:
    reports = [HostReport(f"h{i}", clock_skew=s) for i, s in enumerate((0.0, 4.9, 42.3, -7.0))]
    assert clock_warnings(reports) == [
        "warning: h2's clock is 42 s ahead of this machine's; torch's rendezvous compares timestamps across nodes: "
        "sync the clocks (NTP, e.g. chrony)",
        "warning: h3's clock is 7 s behind this machine's; torch's rendezvous compares timestamps across nodes: "
        "sync the clocks (NTP, e.g. chrony)"]
    assert all(not r.problems for r in reports)  # a warning: preflight still passes


def _probe_clock_skew(folder: Path, env: dict[str, str] | None = None) -> float:
    sent = time.time()
    facts = probe_facts(str(folder), str(folder), str(folder), env=env)
    return clock_skew({**facts, "sent": repr(sent), "answered": repr(time.time())})


def test_the_probe_reads_the_host_clock(tmp_path: Path) -> None:
    """The real probe script, once on this machine's clock and once on a host whose clock is 42 s behind: a `date`
    first on its PATH that answers 42 s early (this machine's clock cannot be moved for one process: a time namespace
    shifts the monotonic clocks only, and libfaketime is not installed)."""
    shifted = tmp_path / "bin"
    shifted.mkdir()
    (shifted / "date").write_text('#!/bin/sh\nexec /usr/bin/date -d "-42 seconds" "$@"\n')
    (shifted / "date").chmod(0o755)
    assert _probe_clock_skew(tmp_path) == 0.0  # one clock: the round trip is not skew
    behind = _probe_clock_skew(tmp_path, env={"PATH": f"{shifted}:/usr/bin:/bin"})
    assert behind == pytest.approx(-42, abs=1)
