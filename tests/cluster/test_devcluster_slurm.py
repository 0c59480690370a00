"""A real Slurm on the simulated hosts (`Cluster.create(..., slurm=True)`, devcluster/slurmd.py): munged,
slurmctld on the machine, slurmd in each host's namespaces under its own hostname; GPUs as gres.

Needs root and Debian's slurm-wlm and munge (scripts/setup.sh installs them). One 2-host cluster with 2
simulated GPUs per host serves the module; the teardown and gc tests make 1-host clusters of their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.orphan import cluster_of_a_child

from devcluster import Cluster
from devcluster.gc import gc
from devcluster.proc import alive, pids_in_netns, pids_matching, read_pidfile
from devcluster.slurmd import slurm_dir

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[Cluster]:
    with Cluster.create(2, gpus=2, slurm=True) as c:
        yield c


def slurm(c: Cluster, *argv: str, timeout: float = 60) -> str:
    """A Slurm client command against c's controller (run from /, a folder every host has); its stdout."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=c.client_env(), cwd="/")
    assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()}"
    return res.stdout


def wait_job_state(c: Cluster, job: str, states: set[str], timeout: float = 60) -> str:
    """Poll the job's state until it is one of states (bounded)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        m = re.search(r"JobState=(\S+)", slurm(c, "scontrol", "show", "job", job))
        state = m.group(1) if m else ""
        if state in states:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job} is {state}, not {states}, after {timeout:.0f} s")


def test_sinfo_shows_every_host_as_an_idle_node_with_its_gpus(slurm_cluster: Cluster) -> None:
    c = slurm_cluster
    lines = slurm(c, "sinfo", "-h", "-N", "-o", "%N %T %G %P").split("\n")
    assert sorted(filter(None, lines)) == [f"{h.name} idle gpu:2 hosts*" for h in c.hosts]


def test_srun_runs_in_each_host_under_its_own_hostname(slurm_cluster: Cluster) -> None:
    """Each task answers with its host's alias (its UTS namespace) from the host's address (its netns)."""
    c = slurm_cluster
    out = slurm(c, "srun", "-N2", "-l", "sh", "-c", 'echo "$(hostname) $(ip -4 -o addr show eth0)"')
    seen = {line.split()[1]: line for line in out.splitlines()}
    assert sorted(seen) == [h.name for h in c.hosts], out
    for h in c.hosts:
        assert f"inet {h.addr}/" in seen[h.name], out


def test_the_login_user_on_a_host_finds_slurm_as_on_a_sites_node(slurm_cluster: Cluster) -> None:
    """No SLURM_CONF in a login's environment: the clients find the node's /run/slurm/conf/slurm.conf; the job
    runs as that user and gets the node's own copy as SLURM_CONF (readable by it)."""
    c = slurm_cluster
    out = c.hosts[1].run(["srun", "-N2", "-l", "sh", "-c", 'echo "$(id -un) $SLURM_CONF"; scontrol show hostnames'],
                         user=c.user, timeout=60).stdout
    expected = [f"{task}: {line}" for task in (0, 1)
                for line in (f"{c.user} /run/slurm/conf/slurm.conf", *(h.name for h in c.hosts))]
    assert sorted(out.splitlines()) == sorted(expected), out


def test_sbatch_runs_a_two_node_job_on_the_nodes_in_slurm_order(slurm_cluster: Cluster) -> None:
    """The batch script runs on the first node, SLURM_JOB_NODELIST names both nodes, `scontrol show hostnames`
    expands it in order; it writes to the first node's own /tmp."""
    c = slurm_cluster
    script = ("#!/bin/sh\n#SBATCH -N 2\n#SBATCH -o /tmp/slurm-%j.out\n"
              'echo "list=$SLURM_JOB_NODELIST host=$(hostname)"\n'
              'echo "order=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"\n')
    job = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=30,
                         env=c.client_env(), cwd="/", check=True).stdout.strip()
    assert wait_job_state(c, job, {"COMPLETED", "FAILED"}) == "COMPLETED"
    out = c.hosts[0].path(f"/tmp/slurm-{job}.out").read_text()
    names = [h.name for h in c.hosts]
    assert f"list=dc-{c.name}-h[0-1] host={names[0]}" in out, out
    assert f"order={','.join(names)}" in out, out


def test_slurm_grants_each_job_its_own_gpu_indices(slurm_cluster: Cluster) -> None:
    """Job A holds one GPU per node; a step of job B that asks for one per node gets the other index, in
    CUDA_VISIBLE_DEVICES, and A's index is in its detailed record (GRES=gpu:1(IDX:N)). Both ask for a little
    memory: a job that does not gets the whole node (DefMemPerNode's default)."""
    c = slurm_cluster
    a = slurm(c, "sbatch", "--parsable", "-N2", "--gpus-per-node", "1", "--mem", "64", "-o", "/dev/null",
              "--wrap", "sleep 300").strip()
    try:
        wait_job_state(c, a, {"RUNNING"})
        held = set(re.findall(r"GRES=gpu:1\(IDX:(\d)\)", slurm(c, "scontrol", "show", "job", "-d", a)))
        assert len(held) == 1, held  # the same index on both nodes: the first free one
        out = slurm(c, "srun", "-N2", "--immediate=30", "--gpus-per-node", "1", "--mem", "64", "sh", "-c",
                    'echo "$(hostname) $CUDA_VISIBLE_DEVICES"')
        granted = {name: cvd for name, _, cvd in (line.partition(" ") for line in out.splitlines())}
        assert sorted(granted) == [h.name for h in c.hosts], out
        assert set(granted.values()) == {"0", "1"} - held, (held, out)
    finally:
        slurm(c, "scancel", a)


def slurm_pids(c: Cluster) -> list[int]:
    """Every process of the cluster's Slurm: slurmctld, slurmd (both name its slurm folder), and whatever runs
    in the hosts' netns (munged, slurmstepd, the jobs)."""
    return pids_matching(str(slurm_dir(c.state)) + "/") + [p for h in c.hosts for p in pids_in_netns(h.netns)]


def test_close_stops_every_slurm_daemon_and_running_job(slurm_cluster: Cluster) -> None:
    """Made beside the module's cluster: each has its own controller (port, state) and sees its own nodes."""
    c = Cluster.create(1, slurm=True)
    try:
        assert slurm(c, "sinfo", "-h", "-N", "-o", "%N").split() == [c.hosts[0].name]
        assert slurm(slurm_cluster, "sinfo", "-h", "-N", "-o", "%N").split() == [h.name for h in slurm_cluster.hosts]
        job = slurm(c, "sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300").strip()
        wait_job_state(c, job, {"RUNNING"})
        ctld = read_pidfile(slurm_dir(c.state) / "slurmctld.pid")
        pids = slurm_pids(c)
        assert ctld in pids and len(pids) >= 4, pids  # slurmctld, slurmd, munged, slurmstepd, sleep
    finally:
        assert c.close() == []
    assert [p for p in pids if alive(p)] == []


def test_gc_stops_the_slurm_of_a_killed_run() -> None:
    proc, c = cluster_of_a_child("1, slurm=True")
    name = c.name
    try:
        pids = slurm_pids(c)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert pids
    assert gc().get(name) == []
    assert [p for p in pids if alive(p)] == []


def test_a_rebooted_host_serves_slurm_jobs_again(slurm_cluster: Cluster) -> None:
    """reboot() ends slurmd and munged with every other process of the host; they start again, and the node
    (ReturnToService=2) takes jobs again."""
    c = slurm_cluster
    h = c.hosts[1]
    before = read_pidfile(slurm_dir(c.state) / h.name / "slurmd.pid")
    h.reboot()
    assert before is not None and not alive(before)
    assert slurm(c, "srun", "-w", h.name, "--immediate=30", "hostname").strip() == h.name
