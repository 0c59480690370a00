"""`check` and `up --check-network` on three real test hosts (no GPU): every part passes on every host (the
self-test of the job's processes under torchrun in the image on each host, the network within and across the
hosts) but the network of the host whose link is throttled, which is named as the outlier, and the two equal
hosts are not; the GPU probe of a GPU job really runs against each host's dockerd and names what is missing there;
a host that cannot reach the master's rendezvous port is named and nothing starts. One `check` serves the first
three tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.lines import table_rows
from kit.orchestrate_kit import IMAGE, PATIENCE, REPO, Data, job_containers, orch_env, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

CHECK_MB = "16"  # enough to tell a 30 Mbit/s link from a veth; the check then takes seconds


@pytest.fixture(scope="module")
def target(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    c = cluster_factory(3, no_sftp=[2])  # the session's three hosts (stock hosts, self-healing)
    yield c
    for h in c.hosts:
        h.throttle(None)


def check(cluster: Cluster, work: Path, hosts: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    res = orchestrate(cluster, work / "state", "check", "--hosts", str(hosts), "--gpus", "0", "--image", IMAGE,
                      "--max-mb", CHECK_MB, "--job", "net", "--model", "tiny", "--precision", "bf16", timeout=600)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def checked(target: Cluster, work: Path, hosts: Path) -> tuple[int, str, float]:
    """One `check` on three hosts, nodes 0 and 1 with equal links (200 Mbit/s each, as equal NICs) and node 2's at
    30 Mbit/s; it also sends the image to hosts that lack it. Unthrottled, a veth runs at whatever CPU this machine
    has left, and beside the other test worker that differed 2x from pair to pair (CI, seen). One run serves every
    test below but the last: a `check` of its own on equal hosts cost about 40 CPU-seconds (its self-test and network
    containers) to show that nothing is flagged there, which the two equal nodes beside the slow one show too
    (and the rule on equal figures is tests/orchestrate/test_netcheck.py's)."""
    for h in target.hosts:
        h.throttle("200mbit")
    target.hosts[2].throttle("30mbit")
    try:
        return check(target, work, hosts)
    finally:
        for h in target.hosts:
            h.throttle(None)


def test_the_slow_host_is_the_outlier_and_the_equal_ones_are_not(target: Cluster, checked: tuple[int, str, float]) -> None:
    rc, out, took = checked
    slow = target.hosts[2]
    assert rc == 1, out  # the outlier alone fails the check: every other part passed (the next test)
    assert "processes per node 2,2,2" in out  # slots=1 hosts: at least 2 per CPU node, within and across
    assert "all 3 nodes: all_reduce bus bandwidth" in out
    assert f"outlier: node 2 ({slow.name})" in out, out
    assert "outlier: node 0" not in out and "outlier: node 1" not in out
    assert "below the floor" not in out
    assert out.count(" <-> ") == 3  # every pair of 3 hosts
    assert job_containers(target, "net-netcheck") == []
    print(f"check on 3 hosts, node 2 at 30 Mbit/s, took {took:.1f} s")


def test_check_prints_one_row_per_node_with_every_part_passed(target: Cluster, checked: tuple[int, str, float]) -> None:
    """Every part passes on every node but node 2's network cell, which says OUTLIER."""
    _, out, _ = checked
    rows = table_rows(out, "self-test")  # below the preflight and network tables; a row may wrap (100 columns)
    for rank, host in enumerate(target.hosts):
        row = next((" | ".join(r) for r in rows if r[0] == str(rank) and r[1].startswith(host.name)), None)
        assert row is not None, f"no row for node {rank} ({host.name}):\n{out}"
        assert "CPU mode" in row and "ddp bf16 on 2 x cpu: 3 steps" in row, row
        assert "saved, loaded, equal" in row and "within " in row and "best pair" in row, row
        assert ("OUTLIER" in row) == (rank == 2), row
    assert job_containers(target, "net-selftest") == [] and job_containers(target, "net-netcheck") == []


def test_the_gpu_probe_runs_on_each_host_and_names_what_is_missing(target: Cluster, work: Path, hosts: Path,
                                                                    checked: tuple[int, str, float]) -> None:
    """Only a GPU host could show a pass; here each host's dockerd refuses the GPU request, as a node without
    the NVIDIA Container Toolkit does. (`checked` sent the image to the hosts.)"""
    res = subprocess.run([sys.executable, str(REPO / "tests" / "cluster" / "gpu_probe_on_hosts.py"), str(hosts), IMAGE],
                         env=orch_env(target, work / "state"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    results = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["label"].split(":")[0] for r in results] == [h.name for h in target.hosts], res.stdout
    for r in results:
        assert r["problem"].startswith("no NVIDIA container runtime is registered with this host's Docker daemon"), r
        assert "\n" not in r["problem"]
    assert job_containers(target, "gpuprobe-test-gpuprobe") == []


def test_a_host_that_cannot_reach_the_master_is_named_and_nothing_starts(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """A firewall on node 1 drops its connections to the rendezvous port (SSH still works: preflight passes)."""
    node1, master = target.hosts[1], target.hosts[0].addr
    rule = ["OUTPUT", "-p", "tcp", "-d", master, "--dport", "29500", "-j", "DROP"]
    node1.run(["iptables", "-w", "5", "-A", *rule])
    try:
        res = orchestrate(target, work / "state", *up_args(hosts, data, "netjob", "--check-network",
                                                           "--check-max-mb", CHECK_MB), timeout=PATIENCE)
    finally:
        node1.run(["iptables", "-w", "5", "-D", *rule])
    assert res.returncode == 1
    assert f"node 1 ({node1.name}): cannot reach the master {master}:29500 from this node" in res.stderr
    assert "nothing was started" in res.stderr and "job 'netjob' started" not in res.stdout
    assert job_containers(target, "netjob") == [] and job_containers(target, "netjob-netcheck") == []
