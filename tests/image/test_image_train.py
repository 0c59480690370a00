"""The trainer runs in the CPU image: a few steps to the end, and `docker stop` in the middle.

Containers run as the orchestrator starts them: under Docker's init, data and checkpoints mounted at
/data and /checkpoints. Each test writes its own synthetic set with the image's `python -m trainer.data synth`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import docker
import pytest
from docker.models.containers import Container
from kit.image_helpers import (
    SYNTH_TRAIN,
    logs_of,
    manifests,
    mounts,
    remove,
    run,
    start,
    synth_data,
    wait,
)
from kit.waits import wait_until

pytestmark = pytest.mark.docker

BATCH = 50
STEPS_PER_EPOCH = SYNTH_TRAIN // BATCH
# The smallest model keeps CPU time low; what is tested here is the image, not the model.
TRAIN_ARGS = ["--data-dir", "/data", "--ckpt-dir", "/checkpoints", "--batch-size", str(BATCH),
              "--model", "tiny", "--device", "cpu", "--allow-unverified-data", "--log-every", "2"]


def assert_valid_checkpoint(manifest_path: Path) -> dict[str, object]:
    """The manifest contract of docs/DESIGN.md §2: the .pt it names exists with that size and sha256."""
    manifest = json.loads(manifest_path.read_text())
    pt = manifest_path.parent / manifest["file"]
    assert pt.is_file(), f"{manifest_path.name} names a missing {pt.name}"
    blob = pt.read_bytes()
    assert manifest["bytes"] == len(blob)
    assert manifest["sha256"] == hashlib.sha256(blob).hexdigest()
    return manifest


def test_trainer_runs_to_the_end_and_writes_checkpoint_manifest_and_metrics(
        docker_client: docker.DockerClient, cpu_image: str, tmp_path: Path) -> None:
    data = synth_data(docker_client, cpu_image, tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    done = run(docker_client, cpu_image, ["python", "-m", "trainer", "--epochs", "2", *TRAIN_ARGS],
               timeout=300, volumes=mounts(data=data, checkpoints=ckpt))
    assert done.exit_code == 0, done.logs
    assert f"DONE epochs=2 step={2 * STEPS_PER_EPOCH}" in done.logs, done.logs[-2000:]

    newest = assert_valid_checkpoint(manifests(ckpt)[-1])
    assert newest["step"] == 2 * STEPS_PER_EPOCH and newest["epoch_complete"] is True
    rows = [r for r in map(json.loads, (ckpt / "metrics.jsonl").read_text().splitlines()) if r.get("kind") != "train_step"]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(0.0 <= r["test_acc"] <= 1.0 and r["world_size"] == 1 for r in rows)


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_docker_stop_reaches_the_trainer_which_checkpoints(
        docker_client: docker.DockerClient, cpu_image: str, tmp_path: Path, launcher: str) -> None:
    """docker stop -> SIGTERM via tini -> (torchrun ->) trainer: it saves at the current step and exits.

    Plain python exits 143 (the trainer's contract). torchrun re-raises the signal as an exception and
    exits non-zero itself; what matters there is that the trainer below it saved its checkpoint.
    """
    data = synth_data(docker_client, cpu_image, tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    prefix = ["python", "-m", "trainer"] if launcher == "python" else ["torchrun", "--nproc_per_node", "1",
                                                                      "-m", "trainer"]
    # Many epochs, so the run is still training when it is stopped.
    container = start(docker_client, cpu_image, [*prefix, "--epochs", "500", *TRAIN_ARGS],
                      volumes=mounts(data=data, checkpoints=ckpt))
    try:
        wait_until(lambda: " step " in logs_of(container) or not running(container), 180, "the first training step")
        container.stop(timeout=30)
        done = wait(container, timeout=60)
    finally:
        remove(container)

    assert "stopped by SIGTERM" in done.logs, done.logs[-3000:]
    if launcher == "python":
        assert done.exit_code == 143, done.logs[-3000:]
    else:
        assert done.exit_code != 0, done.logs[-3000:]
    found = manifests(ckpt)
    assert found, f"no checkpoint after docker stop; logs:\n{done.logs[-3000:]}"
    last = assert_valid_checkpoint(found[-1])
    # The trainer's last line names the step it stopped at; its checkpoint must be that step's.
    stopped_at = re.search(r"stopped by SIGTERM[^\n]*?step (\d+)", done.logs)
    assert stopped_at and int(stopped_at.group(1)) == last["step"], "the newest checkpoint is not the stop step"


def running(container: Container) -> bool:
    container.reload()
    return container.status in ("created", "running")
