"""The CPU image as built by `make image-cpu`: metadata, contents, size, and a build that never pulls."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import docker
import docker.errors
import pytest
from kit.image_helpers import run, unique

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
# The image is copied to every test host over SSH: keep an eye on its size (896 MB when measured).
MAX_IMAGE_BYTES = 1_000_000_000


def project_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml has no version"
    return m.group(1)


def test_metadata(docker_client: docker.DockerClient, cpu_image: str) -> None:
    image = docker_client.images.get(cpu_image)
    cfg = image.attrs["Config"]
    assert cfg["Labels"]["org.opencontainers.image.version"] == project_version()
    assert cfg["Entrypoint"] == ["/app/docker/entrypoint.sh"]
    assert cfg["Cmd"] == ["python", "-m", "trainer", "--help"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["PYTHONPATH"].split(":")[0] == "/app"
    assert env["PATH"].startswith("/opt/venv/bin:")


def test_default_command_prints_the_trainer_help(docker_client: docker.DockerClient, cpu_image: str) -> None:
    done = run(docker_client, cpu_image, None)  # the image's CMD
    assert done.exit_code == 0, done.logs
    assert "--data-dir" in done.logs and "--ckpt-dir" in done.logs


def test_python_torch_and_torchrun_resolve(docker_client: docker.DockerClient, cpu_image: str) -> None:
    script = ("import shutil, torch, numpy, trainer; "
              "print(shutil.which('python'), shutil.which('torchrun'), torch.__version__, trainer.__file__)")
    done = run(docker_client, cpu_image, ["python", "-c", script])
    assert done.exit_code == 0, done.logs
    python, torchrun, torch_version, trainer_file = done.logs.split()
    assert python == "/opt/venv/bin/python" and torchrun == "/opt/venv/bin/torchrun"
    assert torch_version.startswith("2.13.0")
    assert trainer_file == "/app/trainer/__init__.py"


def test_small_and_free_of_caches(docker_client: docker.DockerClient, cpu_image: str) -> None:
    size = docker_client.images.get(cpu_image).attrs["Size"]
    assert size < MAX_IMAGE_BYTES, f"{cpu_image} is {size / 1e6:.0f} MB; every test host receives it"
    check = ("test ! -e /root/.cache/pip && test -z \"$(ls /usr/share/doc)\" && test -z \"$(ls /var/lib/apt/lists)\" "
             "&& test ! -e /opt/venv/lib/python3.11/site-packages/torch/include "
             "&& test ! -e /wheels && ! ls /var/cache/apt/archives/*.deb 2>/dev/null")
    done = run(docker_client, cpu_image, ["sh", "-c", check])
    assert done.exit_code == 0, f"caches, docs or wheels left in the image: {done.logs}"


def test_legacy_build_uses_a_local_base_and_never_pulls(docker_client: docker.DockerClient,
                                                        cpu_image: str) -> None:
    """The base gets a registry-looking name that cannot resolve: a pull attempt would fail the build."""
    base_alias = f"registry.invalid/ddp-cifar-test/{unique('base')}:26.08-py3"
    result_tag = f"ddp-cifar-test:{unique('build')}"
    base = docker_client.images.get("ddp-cifar-base:cpu")
    repo, tag = base_alias.rsplit(":", 1)
    assert base.tag(repo, tag)
    try:
        done = subprocess.run(
            ["docker", "build", "--build-arg", f"BASE_IMAGE={base_alias}", "--build-arg", "VERSION=9.9.9-test",
             "-t", result_tag, "."],
            cwd=REPO, env={**os.environ, "DOCKER_BUILDKIT": "0"}, capture_output=True, text=True,
            timeout=300, check=False,
        )
        assert done.returncode == 0, f"legacy build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        labels = docker_client.images.get(result_tag).attrs["Config"]["Labels"]
        assert labels["org.opencontainers.image.version"] == "9.9.9-test"
        # the base as `up` reads it (docs/image.md); no BASE_DIGEST given: empty (up looks at the base's RepoDigests)
        assert labels["org.opencontainers.image.base.name"] == base_alias
        assert labels["org.opencontainers.image.base.digest"] == ""
    finally:
        for name in (result_tag, base_alias):
            try:
                docker_client.images.remove(name)
            except docker.errors.ImageNotFound:
                pass
