"""Fixtures shared by every test folder.

- ``docker_client`` (session): a Docker SDK client of the local dockerd. When the daemon cannot be
  reached the test FAILS with the reason; it never skips, so CI cannot pass without a real engine.
- ``cpu_image`` (session): the tag ``ddp-cifar:cpu`` (or $DDP_TEST_IMAGE, so that parallel work trees can test
  images of their own); fails with "run make image-cpu" when it is missing.
- ``repo_root``: the repository's root folder (a Path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

CPU_IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(
            f"dockerd is unreachable ({e}); start it (e.g. `dockerd &` as root, or .ci/run) and rerun",
            pytrace=False,
        )
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def cpu_image(docker_client: docker.DockerClient) -> str:
    try:
        docker_client.images.get(CPU_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {CPU_IMAGE} is missing: run make image-cpu", pytrace=False)
    return CPU_IMAGE
