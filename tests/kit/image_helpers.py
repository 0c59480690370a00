"""Helpers for the image tests: run a container of the CPU image to completion, always removing it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import Container

TEST_LABEL = "ddp-cifar.test"
# The synthetic set every training test uses: small, so one epoch is a few steps.
SYNTH_TRAIN, SYNTH_TEST = 600, 200


@dataclass(frozen=True)
class Finished:
    exit_code: int
    logs: str


def unique(prefix: str) -> str:
    """A name no other run (or concurrent test session) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def mounts(**binds: Path) -> dict[str, dict[str, str]]:
    """``data=Path`` -> {"/path": {"bind": "/data", "mode": "rw"}} for the SDK's ``volumes=``."""
    return {str(host): {"bind": f"/{name}", "mode": "rw"} for name, host in binds.items()}


def start(client: docker.DockerClient, image: str, command: list[str] | None, **kwargs: object) -> Container:
    """Start a labelled container under Docker's init (as the orchestrator and compose do); None: the CMD."""
    return client.containers.run(
        image, command, detach=True, init=True, name=unique("ddp-cifar-test"),
        labels={TEST_LABEL: "image"}, **kwargs,
    )


def wait(container: Container, timeout: float) -> Finished:
    """Wait for the container to exit; kill it and raise AssertionError (with its logs) past the timeout."""
    try:
        status = container.wait(timeout=timeout)
    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
        container.kill()
        raise AssertionError(
            f"container {container.name} still running after {timeout:.0f} s; logs:\n{logs_of(container)}"
        ) from None
    return Finished(int(status["StatusCode"]), logs_of(container))


def logs_of(container: Container) -> str:
    return container.logs(stdout=True, stderr=True).decode(errors="replace")


def remove(container: Container) -> None:
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass


def run(client: docker.DockerClient, image: str, command: list[str] | None, timeout: float = 120,
        **kwargs: object) -> Finished:
    """Run a container to its end and remove it, whatever happened."""
    container = start(client, image, command, **kwargs)
    try:
        return wait(container, timeout)
    finally:
        remove(container)


def synth_data(client: docker.DockerClient, image: str, out: Path) -> Path:
    """Write the synthetic CIFAR-10 set into out/ with the image's own trainer (python -m trainer.data synth)."""
    out.mkdir(parents=True, exist_ok=True)
    done = run(client, image, ["python", "-m", "trainer.data", "synth", "--out", "/data",
                               "--train", str(SYNTH_TRAIN), "--test", str(SYNTH_TEST)],
               volumes=mounts(data=out))
    assert done.exit_code == 0, f"synth failed:\n{done.logs}"
    assert (out / "cifar-10-batches-py" / "test_batch").is_file(), done.logs
    return out


def manifests(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("ckpt-*.json"))
