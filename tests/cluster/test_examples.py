"""Bring your own program: the examples (examples/) under `up --entry` on two real test hosts.

Each example: every rank sees its RANK/WORLD_SIZE/DATA_DIR/CKPT_DIR/LOG_DIR and its arguments; torchrun writes
one log file per rank on each node and `logs --rank R` reads rank R's only; kill checkpoints (manifest) and
`up --resume` continues from it (minimal's, RESUMED; the others' resumes run in tests/test_example_programs.py). And preflight refuses an entry that is not in the image, or an image
without torch, before anything starts. Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import docker
import pytest
from kit.lines import LineReader
from kit.orchestrate_kit import (
    PATIENCE,
    example_image,
    job_containers,
    kill_process_group,
    manifests,
    orchestrate,
    start,
    up,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

# An image with Python but no torch: the raw Debian base `make cpu-base` imports before installing torch.
NO_TORCH_IMAGE = os.environ.get("DDP_TEST_NO_TORCH_IMAGE", "ddp-cifar-rootfs:bookworm")
# name → (its folder under examples/, entry, its own arguments; the minimal one passes unknown ones through, to
# show they arrive). charlm-tp: tensor parallelism over the two hosts (dp=1 x tp=2), each rank's MLP half on its own.
EXAMPLES = {
    "minimal": ("minimal", "/app/minimal/train.py", ["--ckpt-every", "1000", "--extra", "x"]),
    "charlm": ("charlm", "-m charlm.train", ["--ckpt-every", "1000", "--text", "input.txt", "--context", "4"]),
    "charlm-tp": ("charlm", "-m charlm.train", ["--ckpt-every", "1000", "--text", "input.txt", "--context", "4",
                                                "--tp", "2"]),
}


def args_for(name: str, steps: int, step_seconds: float) -> list[str]:
    return ["--steps", str(steps), "--step-seconds", str(step_seconds), *EXAMPLES[name][2]]


def contract_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line.split("CONTRACT ", 1)[1]) for line in text.splitlines() if "CONTRACT " in line]


def job_dir(cluster: Cluster, node: int, job: str, kind: str) -> Path:
    """A job's checkpoints/logs folder on a host, as this machine sees it."""
    return cluster.hosts[node].path(f"/home/ddp/.local/share/ddp-cifar/jobs/{job}/{kind}")


def rank_files(cluster: Cluster, node: int, job: str) -> list[Path]:
    return sorted(job_dir(cluster, node, job, "logs").glob("*/attempt_*/*/stdout.log"), key=lambda p: p.stat().st_mtime)


def container_log(cluster: Cluster, job: str, node: int) -> str:
    found = [c for name, c in job_containers(cluster, job) if name == cluster.hosts[node].name]
    return found[0].logs().decode(errors="replace") if found else ""  # type: ignore[attr-defined]


# The example whose checkpoint `up --resume` finds and resumes. The resume is the orchestrator's part, the same for
# every program (the manifest search, RESUME=1 in the contract): once. Each example's own checkpoint is still
# written by `kill`'s SIGTERM here, and read back by its resume in tests/test_example_programs.py (charlm's with
# and without --tp); a resume each cost 2 node starts and an `up` (~25 CPU-seconds for the two).
RESUMED = "minimal"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_contract_rank_logs_kill_and_resume(cluster: Cluster, work: Path, hosts: Path, name: str) -> None:
    folder, entry, _ = EXAMPLES[name]
    args = args_for(name, 400, 0.2)  # slow enough to stop halfway
    image, job = example_image(folder), f"ex-{name}"
    text = work / f"text-{name}"  # the charlm's text, staged into every node's data dir with --data-from
    text.mkdir(exist_ok=True)
    (text / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    res = up(cluster, work, hosts, job, image, entry, "--detach", "--data-from", str(text), args=args)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: "step 10 loss" in container_log(cluster, job, 0), PATIENCE, f"{name} at step 10")

    # One file per rank on each node (one process per node), each with its own rank's contract.
    for node in range(2):
        files = rank_files(cluster, node, job)
        assert len(files) == 1, files
        (seen,) = contract_lines(files[0].read_text())
        assert seen["RANK"] == str(node) and seen["WORLD_SIZE"] == "2" and seen["LOCAL_RANK"] == "0"
        assert (seen["DATA_DIR"], seen["CKPT_DIR"], seen["LOG_DIR"], seen["RESUME"]) == \
            ("/data", "/checkpoints", "/logs", None)
        assert seen["argv"] == args
    logs1 = orchestrate(cluster, work / "state", "logs", "--job", job, "--rank", "1", "--tail", "0")
    assert logs1.returncode == 0
    assert [c["RANK"] for c in contract_lines(logs1.stdout)] == ["1"]  # rank 1's file only
    assert all(line.startswith("[rank 1 ") for line in logs1.stdout.strip().splitlines())
    # -f: rank 1's new lines as they come, rank 1's only.
    follow = start(cluster, work / "state", "logs", "--job", job, "--rank", "1", "-f", "--tail", "1")
    try:
        seen = LineReader(follow.stdout).until(
            lambda lines: any(ln.startswith("[rank 1] ") and "loss" in ln for ln in lines), 60, "rank 1's loss line")
    finally:
        kill_process_group(follow, signal.SIGTERM)
    assert any(ln.startswith("[rank 1] ") and "loss" in ln for ln in seen), seen
    assert not any(ln.startswith("[rank 0]") for ln in seen)

    # kill: SIGTERM → the program checkpoints by the manifest convention and exits 143.
    assert orchestrate(cluster, work / "state", "kill", "--job", job, "--grace", "30").returncode == 0
    saved = manifests(job_dir(cluster, 0, job, "checkpoints"))
    assert saved and saved[-1]["epoch_complete"] is False and int(saved[-1]["step"]) >= 10  # type: ignore[call-overload]
    step = int(saved[-1]["step"])  # type: ignore[call-overload]
    assert f"stopped at step {step} after a checkpoint" in rank_files(cluster, 0, job)[-1].read_text()
    if name != RESUMED:
        return

    # up --resume: the orchestrator finds the checkpoint by its manifest; the program gets RESUME=1.
    res = up(cluster, work, hosts, job, image, entry, "--resume", args=args_for(name, step + 3, 0))
    assert res.returncode == 0, res.stderr
    assert f"resumed at step {step}" in res.stdout and f"DONE step={step + 3}" in res.stdout
    assert f"resuming from {cluster.hosts[0].name}" in res.stdout  # found through the manifest
    resumed = contract_lines(rank_files(cluster, 1, job)[-1].read_text())
    assert resumed[0]["RESUME"] == "1" and resumed[0]["RANK"] == "1"
    assert orchestrate(cluster, work / "state", "kill", "--job", job).returncode == 0


def test_entry_not_in_the_image_is_refused_before_anything_starts(cluster: Cluster, work: Path, hosts: Path) -> None:
    res = up(cluster, work, hosts, "ex-noentry", example_image("minimal"), "/app/not-there.py", args=[])
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "lacks the entry: script '/app/not-there.py' is not a file" in lines[0]
    assert job_containers(cluster, "ex-noentry") == []


def test_image_without_torch_is_refused_before_anything_starts(cluster: Cluster, work: Path, hosts: Path) -> None:
    try:
        docker.from_env().images.get(NO_TORCH_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {NO_TORCH_IMAGE} (Python, no torch) is missing: run make cpu-base", pytrace=False)
    res = up(cluster, work, hosts, "ex-notorch", NO_TORCH_IMAGE, "-m trainer", args=[])
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"image {NO_TORCH_IMAGE} has no torch" in lines[0]
    assert job_containers(cluster, "ex-notorch") == []
