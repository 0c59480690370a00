"""`check` and `up --check-network` on three real test hosts: equal hosts flag nothing, a throttled host is named
as the outlier, a host that cannot reach the master's rendezvous port is named and nothing starts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from orchestrate_kit import IMAGE, PATIENCE, Data, job_containers, orchestrate, up_args

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
                      "--max-mb", CHECK_MB, "--job", "net", "--model", "tiny", timeout=600)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


def test_equal_hosts_flag_nothing(target: Cluster, work: Path, hosts: Path) -> None:
    """Three hosts with equal links (200 Mbit/s each, as equal NICs). Unthrottled, a veth runs at whatever CPU
    this machine has left, and beside the other test worker that differed 2x from pair to pair (CI, seen)."""
    for h in target.hosts:
        h.throttle("200mbit")
    try:
        rc, out, took = check(target, work, hosts)
    finally:
        for h in target.hosts:
            h.throttle(None)
    assert rc == 0, out
    assert "network check (MB/s)" in out and "all 3 nodes: all_reduce bus bandwidth" in out and "OUTLIER" not in out and "outlier" not in out
    assert out.count(" <-> ") == 3  # every pair of 3 hosts
    assert job_containers(target, "net-netcheck") == []
    print(f"check on 3 equal hosts took {took:.1f} s")


def test_a_throttled_host_is_the_outlier(target: Cluster, work: Path, hosts: Path) -> None:
    slow = target.hosts[2]
    slow.throttle("30mbit")
    try:
        rc, out, took = check(target, work, hosts)
    finally:
        slow.throttle(None)
    assert rc == 1, out
    assert f"outlier: node 2 ({slow.name})" in out, out
    assert "outlier: node 0" not in out and "outlier: node 1" not in out
    print(f"check with node 2 at 30 Mbit/s took {took:.1f} s")


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
