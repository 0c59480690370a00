"""compose/docker-compose.yml: two node containers of the CPU image train together (gloo) to the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import docker
import pytest
from kit.image_helpers import SYNTH_TRAIN, synth_data, unique
from kit.net import free_port

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
GPU_FILE = REPO / "compose" / "docker-compose.gpu.yml"
BATCH = 50


def compose(project: str, *args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: apt-get install docker-compose"
    return subprocess.run([exe, "-p", project, "-f", str(COMPOSE_FILE), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_two_nodes_train_to_the_end(docker_client: docker.DockerClient, cpu_image: str, tmp_path: Path) -> None:
    data = synth_data(docker_client, cpu_image, tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    project = unique("ddpcifartest").replace("-", "")
    env = {"DDP_DATA_DIR": str(data), "DDP_CKPT_DIR": str(ckpt), "MASTER_PORT": str(free_port()),
           "DDP_EPOCHS": "2", "DDP_BATCH_SIZE": str(BATCH), "DDP_MODEL": "tiny", "DDP_IMAGE": cpu_image}
    try:
        # Plain `up` waits for both nodes: with --abort-on-container-exit, the first node to finish
        # would stop the other during its own clean exit (exit 143), see docs/image.md.
        up = compose(project, "up", "--no-color", env=env, timeout=420)
        containers = docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
        codes = {c.labels["com.docker.compose.service"]: c.attrs["State"]["ExitCode"] for c in containers}
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-2000:]
        assert codes == {"node0": 0, "node1": 0}, f"exit codes {codes}\n{up.stdout[-4000:]}"
    finally:
        down = compose(project, "down", "--remove-orphans", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not docker_client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})

    steps = 2 * SYNTH_TRAIN // (2 * BATCH)  # two processes share each epoch
    assert f"DONE epochs=2 step={steps}" in up.stdout, up.stdout[-4000:]
    rows = [r for r in map(json.loads, (ckpt / "metrics.jsonl").read_text().splitlines()) if r.get("kind") != "train_step"]
    assert [r["world_size"] for r in rows] == [2, 2]
    assert (ckpt / f"ckpt-{steps:08d}.json").is_file()


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, GPU_FILE]], ids=["cpu", "gpu"])
def test_compose_v1_accepts_the_files(files: list[Path]) -> None:
    """docker-compose 1.29 (Debian's) validates both files; the GPU one splits the GPUs between the nodes."""
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: apt-get install docker-compose"
    args = [a for f in files for a in ("-f", str(f))]
    env = {**os.environ, "DDP_NODE0_GPUS": "0,1", "DDP_NODE1_GPUS": "2,3"}
    done = subprocess.run([exe, *args, "config"], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    if GPU_FILE in files:
        assert "- 0,1" in done.stdout and "- 2,3" in done.stdout and "--device=cuda" in done.stdout
        assert "ipc: host" in done.stdout
