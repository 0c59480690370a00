"""GPU sets on 2 test hosts whose simulated nvidia-smi reports 4 GPUs (`devcluster up --gpus 4`; jobs run with
`--gpus-on-cpu`, docs/shared-hosts.md): real sshd, dockerd, torchrun and labels; the containers run on CPU, so
only a GPU node shows CUDA honouring the set. The program is examples/minimal (init, all_reduce, a tiny model)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from orchestrate_kit import job_containers, orchestrate, start
from test_examples import example_image

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

PAIRS = int(os.environ.get("GPU_SET_PAIRS", "3"))  # simultaneous pairs of `up --detach`; CI runs 3, the figures in
# docs/shared-hosts.md come from a run with GPU_SET_PAIRS=10
HOLD = ("--steps", "3000", "--step-seconds", "0.2", "--ckpt-every", "100000")  # runs until killed


@pytest.fixture(scope="module")
def target(cluster_factory):  # type: ignore[no-untyped-def]
    return cluster_factory(2, fresh=True, gpus=4, seeded=True)  # the base layers there: the warm-up sends the top


@pytest.fixture(scope="module")
def image(target: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """examples/minimal's image, sent to the hosts by one `up` first: what is tested is the claim, not two
    image transfers at once."""
    tag, work = example_image("minimal"), tmp_path_factory.mktemp("warm")
    hosts = target.write_hosts_file(work / "hosts.txt")
    warm = ["up", "--hosts", str(hosts), "--job", "warm", "--gpus", "0", "--image", tag, "--layer-cache", "off", "--entry",
            "/app/minimal/train.py", "--", "--steps", "1"]
    assert orchestrate(target, work, *warm).returncode == 0
    assert orchestrate(target, work, "kill", "--hosts", str(hosts), "--job", "warm").returncode == 0
    return tag


def gpu_up(hosts: Path, image: str, job: str, gpus: str) -> list[str]:
    return ["up", "--hosts", str(hosts), "--job", job, "--gpus", gpus, "--gpus-on-cpu", "--image", image,
            "--entry", "/app/minimal/train.py", "--grace", "10", "--detach", "--", *HOLD]


def held(cluster: Cluster, job: str) -> dict[str, tuple[str, str]]:
    """host → (GPU set label, master-port label) of the job's running containers."""
    return {host: (c.labels.get("ddp-cifar.gpus", ""), c.labels.get("ddp-cifar.master-port", ""))  # type: ignore[attr-defined]
            for host, c in job_containers(cluster, job) if c.status == "running"}  # type: ignore[attr-defined]


def disjoint(cluster: Cluster, a: str, b: str) -> bool:
    sets_a, sets_b = held(cluster, a), held(cluster, b)
    return len(sets_a) == len(sets_b) == len(cluster.hosts) and all(
        not set(sets_a[h][0].split(",")) & set(sets_b[h][0].split(",")) for h in sets_a)


def start_pair(target: Cluster, state: Path, hosts: Path, image: str, jobs: tuple[str, str]) -> list[str]:
    runs = [start(target, state / job, *gpu_up(hosts, image, job, "2")) for job in jobs]
    outs = [p.communicate(timeout=300)[0] for p in runs]
    for job, p, out in zip(jobs, runs, outs, strict=True):
        print(f"[{job}] up rc={p.returncode}\n{out}")
    assert [p.returncode for p in runs] == [0, 0]
    return outs


def kill(target: Cluster, state: Path, hosts: Path, *jobs: str) -> None:
    for job in jobs:
        assert orchestrate(target, state / job, "kill", "--hosts", str(hosts), "--job", job).returncode == 0


def test_two_jobs_of_2_gpus_side_by_side_then_a_third_and_all_are_refused(target: Cluster, image: str, tmp_path: Path) -> None:
    hosts = target.write_hosts_file(tmp_path / "hosts.txt")
    start_pair(target, tmp_path, hosts, image, ("gs-a", "gs-b"))
    try:
        assert disjoint(target, "gs-a", "gs-b"), (held(target, "gs-a"), held(target, "gs-b"))
        ports = {held(target, job)[target.hosts[0].name][1] for job in ("gs-a", "gs-b")}
        assert len(ports) == 2 and "" not in ports  # node 0 of each: its own master port, not given
        third = orchestrate(target, tmp_path / "gs-c", *gpu_up(hosts, image, "gs-c", "2"))
        assert third.returncode == 1 and job_containers(target, "gs-c") == []
        refusal = [ln for ln in third.stderr.splitlines() if "--gpus 2: 0 of 4 GPU(s) free here" in ln]
        assert refusal and all("ddp/gs-a" in ln and "ddp/gs-b" in ln for ln in refusal), third.stderr
        every = orchestrate(target, tmp_path / "gs-d", *gpu_up(hosts, image, "gs-d", "all"))
        assert every.returncode == 1 and "--gpus all: held by" in every.stderr and job_containers(target, "gs-d") == []
    finally:
        kill(target, tmp_path, hosts, "gs-a", "gs-b")


def test_simultaneous_pairs_never_share_a_device(target: Cluster, image: str, tmp_path: Path) -> None:
    hosts = target.write_hosts_file(tmp_path / "hosts.txt")
    lost, waited, began = 0, 0.0, time.monotonic()
    for n in range(PAIRS):
        jobs = (f"p{n}-a", f"p{n}-b")
        outs = start_pair(target, tmp_path, hosts, image, jobs)
        try:
            assert disjoint(target, *jobs), (held(target, jobs[0]), held(target, jobs[1]))
        finally:
            kill(target, tmp_path, hosts, *jobs)
        claims = [ln for out in outs for ln in out.splitlines() if ln.startswith("claim ")]
        lost += len(claims)
        waited += sum(float(ln.rsplit(" in ", 1)[1].split(" s")[0]) for ln in claims)
    print(f"FIGURES pairs={PAIRS} ups={2 * PAIRS} tries={2 * PAIRS + lost} collisions={lost} "
          f"waited_s={waited:.1f} wall_s={time.monotonic() - began:.0f}")
