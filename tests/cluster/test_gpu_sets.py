"""GPU sets on 2 test hosts whose simulated nvidia-smi reports 4 GPUs (`devcluster up --gpus 4`; its clients'
environment sets DEVCLUSTER_GPUS_ON_CPU=1, so jobs hold their GPU sets on CPU, docs/shared-hosts.md): real sshd,
dockerd, torchrun and labels; the containers run on CPU, so only a GPU node shows CUDA honouring the set. The program is examples/minimal (init, all_reduce, a tiny model)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from kit.gated_orchestrate import CLAIM_GATE_ENV
from kit.orchestrate_kit import (
    PATIENCE,
    Up,
    example_image,
    job_containers,
    kill_process_group,
    orch_env,
    orchestrate,
    spawn,
    wait_for,
)

from devcluster import Cluster
from orchestrate.backends.docker_ssh.claim import BACKOFF_S

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

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
    return ["up", "--hosts", str(hosts), "--job", job, "--gpus", gpus, "--image", image,
            "--entry", "/app/minimal/train.py", "--grace", "10", "--detach", "--", *HOLD]


def held(cluster: Cluster, job: str) -> dict[str, tuple[str, str]]:
    """host → (GPU set label, master-port label) of the job's running containers."""
    return {host: (c.labels.get("ddp-cifar.gpus", ""), c.labels.get("ddp-cifar.master-port", ""))  # type: ignore[attr-defined]
            for host, c in job_containers(cluster, job) if c.status == "running"}  # type: ignore[attr-defined]


def disjoint(cluster: Cluster, a: str, b: str) -> bool:
    sets_a, sets_b = held(cluster, a), held(cluster, b)
    return len(sets_a) == len(sets_b) == len(cluster.hosts) and all(
        not set(sets_a[h][0].split(",")) & set(sets_b[h][0].split(",")) for h in sets_a)


def gated_pair(target: Cluster, state: Path, hosts: Path, image: str, first: tuple[str, str],
               second: tuple[str, str]) -> tuple[int, str, subprocess.CompletedProcess[str]]:
    """The race forced, every time: the `up` of `first` (job, --gpus) chooses its GPU set from labels that show no
    other job, and its claim gate (tests/kit/gated_orchestrate.py) holds it there, before its containers exist, until the
    `up` of `second` has created, checked and started its own. Then the first goes on: its exit code and output,
    and the second's run."""
    gate = state / f"{first[0]}-claim-gate"
    env = {**orch_env(target, state / first[0]), CLAIM_GATE_ENV: str(gate)}
    held_up = Up(spawn(gpu_up(hosts, image, *first), env, merge_stderr=True))
    try:
        wait_for(lambda: Path(f"{gate}.reached").exists() or held_up.proc.poll() is not None, PATIENCE,
                 f"{first[0]}'s up at its claim gate")
        assert held_up.proc.poll() is None, held_up.text
        won = orchestrate(target, state / second[0], *gpu_up(hosts, image, *second))
        gate.touch()
        return held_up.wait(PATIENCE), held_up.text, won
    finally:
        kill_process_group(held_up.proc, signal.SIGKILL)


def kill(target: Cluster, state: Path, hosts: Path, *jobs: str) -> None:
    for job in jobs:
        assert orchestrate(target, state / job, "kill", "--hosts", str(hosts), "--job", job).returncode == 0


def test_a_claim_that_lost_the_race_plans_again_on_other_gpus_then_a_third_and_all_are_refused(
        target: Cluster, image: str, tmp_path: Path) -> None:
    """gs-a chose GPUs 0,1 and node 0's first free port; gs-b claimed the same meanwhile. gs-a's claim check sees
    gs-b's containers created first, removes its own, and plans again on fresh labels: the other two GPUs and
    another port. Never both on one GPU."""
    hosts = target.write_hosts_file(tmp_path / "hosts.txt")
    code, text, won = gated_pair(target, tmp_path, hosts, image, ("gs-a", "2"), ("gs-b", "2"))
    try:
        assert won.returncode == 0 and code == 0, text
        lost = [ln for ln in text.splitlines() if ln.startswith("claim ")]
        assert len(lost) == 1 and lost[0].startswith("claim 1 lost: ") and "ddp/gs-b created first" in lost[0], text
        assert BACKOFF_S[0] <= float(lost[0].rsplit(" in ", 1)[1].removesuffix(" s")) <= BACKOFF_S[1], lost
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


def test_a_claim_that_lost_the_race_with_too_few_gpus_left_is_refused(
        target: Cluster, image: str, tmp_path: Path) -> None:
    """gs-e chose 3 of the 4 GPUs; gs-f claimed 2 of them meanwhile. gs-e plans again, 2 are free, and it is
    refused: one error line, then one line per host naming the holder; none of its containers is left."""
    hosts = target.write_hosts_file(tmp_path / "hosts.txt")
    code, text, won = gated_pair(target, tmp_path, hosts, image, ("gs-e", "3"), ("gs-f", "2"))
    try:
        assert won.returncode == 0 and code == 1, text
        assert job_containers(target, "gs-e") == [] and len(held(target, "gs-f")) == len(target.hosts)
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert errors == ["error: another job took what this one planned to use; nothing was started:"], text
        why = [ln for ln in text.splitlines() if "--gpus 3: 2 of 4 GPU(s) free here, held by ddp/gs-f (GPU 0,1)" in ln]
        assert len(why) == len(target.hosts), text  # one line per host
    finally:
        kill(target, tmp_path, hosts, "gs-f")
