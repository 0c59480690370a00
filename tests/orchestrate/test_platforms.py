"""Image and node architectures: the decision and its one line per host (no arm64 node here to try it on)."""

from __future__ import annotations

import pytest

from orchestrate.errors import PreflightError
from orchestrate.probe.platforms import docker_arch, mismatch, require_same


def test_uname_names_map_to_dockers() -> None:
    assert docker_arch("x86_64") == "amd64" and docker_arch("aarch64") == "arm64"
    assert docker_arch("ppc64le") == "ppc64le"


def test_same_platform_passes_whatever_the_spelling() -> None:
    assert mismatch("img:1", "linux", "amd64", "linux", "x86_64") is None
    assert mismatch("img:1", "linux", "arm64", "linux", "aarch64") is None


def test_an_arm64_image_on_an_amd64_node_says_how_to_build_for_it() -> None:
    line = mismatch("ddp-cifar:latest", "linux", "arm64", "linux", "x86_64")
    assert line == ("image ddp-cifar:latest is linux/arm64, this node is linux/amd64: it would fail with 'exec "
                    "format error'; build for the node: docker build --platform linux/amd64 -t ddp-cifar:latest .")


def test_every_mismatched_node_is_named_once() -> None:
    # each node's daemon as the scheduler reads it (backends/docker_ssh/observe.py node_platform): (os, uname -m)
    nodes = [("a", ("linux", "x86_64")), ("gh200-1", ("linux", "aarch64")), ("gh200-2", ("linux", "aarch64"))]
    with pytest.raises(PreflightError) as err:
        require_same("img:1", ("linux", "amd64"), nodes)
    lines = str(err.value).splitlines()[1:]
    assert [ln.split(":")[0].strip() for ln in lines] == ["gh200-1", "gh200-2"]
    assert all("docker build --platform linux/arm64" in ln for ln in lines)
    require_same("img:1", None, nodes)  # no local image: nothing is sent, nothing to compare
