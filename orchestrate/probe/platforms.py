"""Image and node architectures must match: an arm64 image (built on Apple silicon) on amd64 nodes, or an amd64
image on GH200 (arm64) nodes, fails only at start, with `exec format error`. Preflight compares the local image's
platform (what `up` sends) with each node's Docker daemon's architecture before anything is sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrate.errors import PreflightError
from orchestrate.remote.ssh import fan_out

# uname -m (what `docker info` reports as Architecture) -> Docker's platform name (GOARCH, as in
# `docker build --platform linux/<name>` and in an image's Architecture field).
DOCKER_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
               "armv6l": "arm", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386",
               "i386": "386"}


def docker_arch(machine: str) -> str:
    """PURE: uname -m -> Docker's name; an unknown one stays as it is."""
    return DOCKER_ARCH.get(machine, machine)


def mismatch(image: str, image_os: str, image_arch: str, node_os: str, node_machine: str) -> str | None:
    """PURE: why this image cannot run on this node (None when it can), with the build command that fixes it."""
    node_arch = docker_arch(node_machine)
    if (image_os, docker_arch(image_arch)) == (node_os, node_arch):
        return None
    return (f"image {image} is {image_os}/{image_arch}, this node is {node_os}/{node_arch}: it would fail with "
            f"'exec format error'; build for the node: docker build --platform {node_os}/{node_arch} -t {image} .")


def local_platform(local_client: Any, image: str) -> tuple[str, str] | None:
    """(os, architecture) of the local image; None when there is no local image (then nothing is sent)."""
    if local_client is None:
        return None
    import docker.errors

    try:
        attrs = local_client.images.get(image).attrs
    except docker.errors.ImageNotFound:
        return None
    return str(attrs.get("Os") or "linux"), str(attrs.get("Architecture") or "")


def require_same(image: str, platform: tuple[str, str] | None, nodes: Sequence[tuple[str, Any]]) -> None:
    """Every node's daemon (label, client) can run the local image; PreflightError with one line per host."""
    if platform is None:
        return

    def problem(node: tuple[str, Any]) -> str | None:
        info = node[1].info()
        return mismatch(image, *platform, str(info.get("OSType") or "linux"), str(info.get("Architecture")))

    found = fan_out("platform check", list(nodes), problem, lambda node: node[0])
    lines = [f"{label}: {line}" for (label, _), line in zip(nodes, found, strict=True) if line]
    if lines:
        raise PreflightError("preflight failed, nothing was started:\n  " + "\n  ".join(lines))
