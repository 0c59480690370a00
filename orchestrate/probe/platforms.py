"""Image and node architectures must match: an arm64 image (built on Apple silicon) on amd64 nodes, or an amd64
image on GH200 (arm64) nodes, fails only at start, with `exec format error`. Preflight compares the local image's
platform (what `up` sends) with each node's Docker daemon's architecture before anything is sent (the scheduler reads
both: backends/docker_ssh/observe.py)."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrate.errors import PreflightError

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


def require_same(image: str, platform: tuple[str, str] | None, nodes: Sequence[tuple[str, tuple[str, str]]]) -> None:
    """PURE: every node (label, (os, machine) of its daemon) can run the local image of `platform` (None: there is
    none, nothing is sent); PreflightError with one line per host."""
    if platform is None:
        return
    lines = [f"{label}: {line}" for label, (node_os, machine) in nodes
             if (line := mismatch(image, *platform, node_os, machine))]
    if lines:
        raise PreflightError("preflight failed, nothing was started:\n  " + "\n  ".join(lines))
