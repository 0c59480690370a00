"""A trainer change for the image-delivery tests and bench/image_delta.py: the same build as `image`, with one
line added to trainer/, on the local daemon. Built from a copy of the build context with the image's own
VERSION and BASE_IMAGE, so every layer before trainer/'s comes from the build cache unchanged."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import docker

REPO = Path(__file__).resolve().parents[2]
CONTEXT = ("Dockerfile", ".dockerignore", "docker", "trainer")


def build_changed_image(image: str, tag: str, base: str = "ddp-cifar-base:cpu", line: str = "") -> str:
    """Build `tag`: `image`'s sources plus one comment line in trainer/__init__.py. Returns its image ID."""
    version = docker.from_env().images.get(image).labels.get("org.opencontainers.image.version", "0.0.0")
    with tempfile.TemporaryDirectory(prefix="ddp-cifar-change-") as tmp:
        # cp -a: the legacy builder's cache key of a COPY covers file metadata that shutil.copytree changes
        subprocess.run(["cp", "-a", *(str(REPO / n) for n in CONTEXT), tmp], check=True, timeout=60)
        init = Path(tmp) / "trainer" / "__init__.py"
        init.write_text(init.read_text() + f"# one-line change for the image-delta test {line or tag}\n")
        subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base}", "--build-arg",
                        f"VERSION={version}", "-t", tag, tmp], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return str(docker.from_env().images.get(tag).id)


def load_image(image: str, docker_host: str) -> None:
    """Give a test host an image directly (`docker save | docker load` on its local socket): test setup."""
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    subprocess.run(["docker", "-H", docker_host, "load", "-q"], stdin=save.stdout, check=True,
                   capture_output=True, timeout=600)
    assert save.stdout is not None
    save.stdout.close()
    assert save.wait(timeout=60) == 0
