"""`up`, `status`, `logs`, `kill` and `up --resume` on two real test hosts (sshd + dockerd + torchrun, CPU image).

Needs root, the local dockerd and `make image-cpu`. Each host gets its own data/checkpoint dirs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from kit.orchestrate_kit import (
    IMAGE,
    PATIENCE,
    Data,
    data_dir,
    default_dirs,
    job_containers,
    job_dir,
    kill_process_group,
    manifests,
    orchestrate,
    sigterm_step,
    start,
    throttle_job,
    up_args,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def target(fresh: Cluster) -> Cluster:
    """This module's `data` and `hosts` (tests/cluster/conftest.py) use the fresh cluster."""
    return fresh


def _timed_ranks(cluster: Cluster, job: str) -> tuple[int, int]:
    """(ranks, ranks per node) that rank 0's last step record with every rank's timings counts."""
    rows = [json.loads(ln) for ln in (job_dir(cluster, 0, job) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r.get("kind") == "train_step" and r.get("rank_work_s")]
    assert timed, rows[-4:]
    return len(timed[-1]["rank_work_s"]), timed[-1]["ranks_per_node"]


def test_first_up_moves_image_and_data_and_trains_one_proc_per_node(
        fresh: Cluster, work: Path, data: Data, hosts: Path) -> None:
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "one", trainer=("--epochs", "3", "--log-every", "4")))
    assert res.returncode == 0
    out = res.stdout
    for h in fresh.hosts:
        assert f"image {IMAGE} on {h.name}: sent" in out
        assert f"data on {h.name}: downloaded" in out
    assert "finished: epochs=3" in out and "world_size=2" in out and "test_acc=" in out
    # Each node runs its own rank (one process per node), the trainer sees world size 2: rank 0's step records carry
    # both ranks' own step times, one rank per node (rank 1 itself prints nothing: logging is rank 0's alone). The
    # figures lag one 8-step agreement window and epochs are 8 steps here: the third epoch's records have them.
    assert "[node 0] " in out
    assert _timed_ranks(fresh, "one") == (2, 1)
    assert "process group up: backend=gloo world_size=2" in out
    # c10d's reverse lookups of the peers' addresses are answered (/etc/hosts): none of its per-connection
    # "hostname ... cannot be retrieved" warnings, on hosts without reverse DNS.
    assert "cannot be retrieved" not in out
    # What the containers were given: ranks, master address, world size.
    for host_name, c in job_containers(fresh, "one"):
        env = dict(e.split("=", 1) for e in c.attrs["Config"]["Env"])
        rank = c.labels["ddp-cifar.node-rank"]
        assert c.name == f"one-node{rank}-{fresh.user}" and host_name == fresh.hosts[int(rank)].name
        assert env["MASTER_ADDR"] == fresh.hosts[0].addr and env["NODE_RANK"] == rank and env["NNODES"] == "2"
        assert env["GLOO_SOCKET_IFNAME"] == "eth0"
        cmd = c.attrs["Config"]["Cmd"]
        assert cmd[cmd.index("--node_rank") + 1] == rank and cmd[cmd.index("--nnodes") + 1] == "2"
        assert not c.attrs["HostConfig"]["Privileged"]
        assert all("docker.sock" not in (m.get("Source") or "") for m in c.attrs["Mounts"])
    assert manifests(job_dir(fresh, 0, "one"))
    # The containers ran as the SSH login (non-root on these hosts): everything in the dirs is the user's.
    for i, h in enumerate(fresh.hosts):
        assert list(data_dir(fresh, i).iterdir()) and list(job_dir(fresh, i, "one", "logs").iterdir())
        for folder in default_dirs(fresh, i, "one").values():
            assert h.path(folder).is_dir() and h.foreign_files(folder) == [], folder


def test_second_up_moves_nothing_and_trains_two_procs_per_node(
        fresh: Cluster, work: Path, data: Data, hosts: Path) -> None:
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "two", "--nproc-per-node", "2",
                                                      trainer=("--epochs", "3", "--log-every", "4")))
    assert res.returncode == 0
    out = res.stdout
    for h in fresh.hosts:
        assert f"image {IMAGE} on {h.name}: already there, nothing sent" in out
        assert f"data on {h.name}: verified copy present, nothing moved" in out
    assert "MB compressed" not in out and "downloaded" not in out
    assert "finished: epochs=3" in out and "world_size=4" in out
    # Two processes per node: rank 0's step records time 4 ranks, 2 per node (node 1 holds ranks 2 and 3).
    assert _timed_ranks(fresh, "two") == (4, 2)


def test_kill_status_logs_then_resume(fresh: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state = work / "state"
    # Never ending by itself: the victim must still train when `kill` comes after the checks below (with 40 epochs
    # it once finished first, exit 0 and no SIGTERM checkpoint, on a quiet machine: CI, seventh session).
    long = ("--epochs", "100000")
    res_a = orchestrate(fresh, state, *up_args(hosts, data, "victim", "--detach", trainer=long))
    res_b = orchestrate(fresh, state, *up_args(hosts, data, "bystander", "--detach", "--master-port", "29611",
                                               trainer=long))
    assert res_a.returncode == 0 and res_b.returncode == 0
    ckpt = job_dir(fresh, 0, "victim")
    try:
        # The bystander only has to stay untouched (running) until the end: a tenth of a core per container.
        wait_for(lambda: len([c for _, c in job_containers(fresh, "bystander") if c.status == "running"]) == 2,
                 PATIENCE, "the bystander's containers to run", every=0.5)
        assert throttle_job(fresh, "bystander") == 2
        wait_for(lambda: len(manifests(ckpt)) >= 1, PATIENCE, "a first checkpoint of job victim")
        # A second `up` of a running job is refused (no --replace), and nothing changes.
        again = orchestrate(fresh, state, *up_args(hosts, data, "victim", "--detach", trainer=long))
        assert again.returncode != 0 and "already running" in again.stderr

        status = orchestrate(fresh, state, "status", "--job", "victim")
        assert status.returncode == 0
        assert status.stdout.count("running") >= 2 and "victim-node0" in status.stdout
        assert "ckpt-" in status.stdout  # newest checkpoint column

        # Node 0's lines alone (global rank 0 logs; the other ranks are quiet unless they warn or fail).
        logs = orchestrate(fresh, state, "logs", "--job", "victim", "--node", "0", "--tail", "5")
        assert logs.returncode == 0 and logs.stdout.strip()
        assert all(ln.startswith("[node 0] ") for ln in logs.stdout.strip().splitlines())
        quiet = orchestrate(fresh, state, "logs", "--job", "victim", "--node", "1", "--tail", "5")
        assert quiet.returncode == 0 and all(ln.startswith("[node 1] ") for ln in quiet.stdout.strip().splitlines())
        # Rank 0's own files: the trainer's stack-rank0.txt and tensorboard/ beside its run folder are newer, not runs.
        rank0 = orchestrate(fresh, state, "logs", "--job", "victim", "--rank", "0", "--tail", "3")
        assert rank0.returncode == 0, rank0.stderr
        assert rank0.stdout.strip() and all(ln.startswith("[rank 0 ") for ln in rank0.stdout.strip().splitlines())

        killed = orchestrate(fresh, state, "kill", "--job", "victim", "--grace", "30")  # hosts remembered
        assert killed.returncode == 0
        assert job_containers(fresh, "victim") == []  # nothing of the job left on any host
        # The checkpoint written on SIGTERM is the newest, at exactly the step the trainer says it stopped at.
        stopped = sigterm_step(fresh, 0, "victim")
        assert stopped is not None and max(m["step"] for m in manifests(ckpt)) == stopped
        by = job_containers(fresh, "bystander")
        assert len(by) == 2 and all(c.status == "running" for _, c in by)  # the other job is untouched

        twice = orchestrate(fresh, state, "kill", "--job", "victim")
        assert twice.returncode == 0 and "no container of job 'victim'" in twice.stdout
    finally:
        orchestrate(fresh, state, "kill", "--job", "bystander", "--grace", "5")

    last = max(manifests(ckpt), key=lambda m: m["step"])
    stopped_at, target = int(last["step"]), int(last["epoch"]) + 1  # one more epoch than was reached
    resumed = orchestrate(fresh, state, *up_args(hosts, data, "victim", "--resume",
                                                 trainer=("--epochs", str(target))), timeout=600)
    assert resumed.returncode == 0
    assert f"ckpt-{stopped_at:08d}.pt" in resumed.stdout.split("resuming from", 1)[1].splitlines()[0]
    assert f"finished: epochs={target}" in resumed.stdout
    assert max(m["step"] for m in manifests(ckpt)) > stopped_at


def test_resume_without_checkpoint_is_refused(fresh: Cluster, work: Path, data: Data, hosts: Path) -> None:
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "never-ran", "--resume", trainer=("--epochs", "1")))
    assert res.returncode != 0
    assert "--resume: no valid checkpoint of this job" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert job_containers(fresh, "never-ran") == []


def test_orchestrator_killed_during_up_is_cleaned_by_labels(
        fresh: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """The orchestrator dies while attached: the containers run on; `up --replace` finds them by label."""
    state = work / "state"
    proc = start(fresh, state, *up_args(hosts, data, "orphan", trainer=("--epochs", "40")))
    try:
        # Until a checkpoint: node 0's torchrun then holds the master port, which --replace must accept.
        wait_for(lambda: len([c for _, c in job_containers(fresh, "orphan") if c.status == "running"]) == 2
                 and len(manifests(job_dir(fresh, 0, "orphan"))) >= 1, PATIENCE, "the job to run and checkpoint")
    finally:
        kill_process_group(proc, signal.SIGKILL)
        proc.wait(timeout=30)
    old = {c.id for _, c in job_containers(fresh, "orphan")}
    assert len(old) == 2  # left running: nothing cleaned them up yet
    replaced = orchestrate(fresh, state, *up_args(hosts, data, "orphan", "--replace", "--detach",
                                                  trainer=("--epochs", "40")))
    assert replaced.returncode == 0
    now = job_containers(fresh, "orphan")  # every container of the job, exited ones too
    ids = {c.id for _, c in now}
    # Two new containers, both running; the old ones are gone from every host, not merely stopped.
    assert len(ids) == 2 and not ids & old and all(c.status == "running" for _, c in now), (old, now)
    for host in fresh.hosts:
        client = host.docker_client()
        try:
            assert not {c.id for c in client.containers.list(all=True)} & old
        finally:
            client.close()
    killed = orchestrate(fresh, state, "kill", "--job", "orphan", "--grace", "5")
    assert killed.returncode == 0 and job_containers(fresh, "orphan") == []
