"""The image's base as the plan sees it: read from the image's labels, pinned to a digest, or refused with a why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import docker.errors

from orchestrate.backends.docker_ssh.observe import local_base
from orchestrate.probe.baseimage import BASE_DIGEST_LABEL, BASE_NAME_LABEL, pinned_ref, repository
from orchestrate.probe.observations import LocalBase


def test_the_repository_is_the_name_without_tag_or_digest() -> None:
    assert repository("nvcr.io/nvidia/pytorch:26.08-py3") == "nvcr.io/nvidia/pytorch"
    assert repository("10.1.2.1:5000/base:cpu") == "10.1.2.1:5000/base"  # a port is not a tag
    assert repository("10.1.2.1:5000/base") == "10.1.2.1:5000/base"
    assert repository("ubuntu@sha256:ab") == "ubuntu"


def test_a_node_pulls_the_base_only_by_its_digest() -> None:
    assert pinned_ref("nvcr.io/nvidia/pytorch:26.08-py3", "sha256:aa", []) == "nvcr.io/nvidia/pytorch@sha256:aa"
    assert pinned_ref("nvcr.io/nvidia/pytorch:26.08-py3", "", ["other.io/x@sha256:bb", "nvcr.io/nvidia/pytorch@sha256:cc"]
                      ) == "nvcr.io/nvidia/pytorch@sha256:cc"
    assert pinned_ref("docker.io/library/ubuntu:24.04", "", ["ubuntu@sha256:dd"]) == "docker.io/library/ubuntu@sha256:dd"
    assert pinned_ref("ddp-cifar-base:cpu", "", []) is None  # built here: no registry holds it


@dataclass
class _Image:
    attrs: dict[str, Any]


@dataclass
class _Images:
    held: dict[str, _Image] = field(default_factory=dict)

    def get(self, name: str) -> _Image:
        if name not in self.held:
            raise docker.errors.ImageNotFound(name)
        return self.held[name]


@dataclass
class _Client:
    images: _Images


def _client(**held: list[str]) -> _Client:
    return _Client(_Images({name: _Image({"RootFS": {"Layers": layers}, "RepoDigests": []})
                            for name, layers in held.items()}))


def test_the_base_is_read_from_the_labels_and_checked_against_the_local_base() -> None:
    layers = ["sha256:a", "sha256:b", "sha256:c"]
    labels = {BASE_NAME_LABEL: "base", BASE_DIGEST_LABEL: "sha256:d"}
    assert local_base(_client(), {}, layers) is None  # no label: no base
    assert local_base(_client(base=["sha256:a", "sha256:b"]), labels, layers) == LocalBase("base", 2, "base@sha256:d")
    missing = local_base(_client(), labels, layers)
    assert missing is not None and (missing.layers, missing.why) == (
        0, "base is not on this machine, so which layers are its own is not known")
    other = local_base(_client(base=["sha256:x"]), labels, layers)
    assert other is not None and other.why == "base on this machine is not the base the image was built on"
    unpinned = local_base(_client(base=["sha256:a"]), {BASE_NAME_LABEL: "base", BASE_DIGEST_LABEL: ""}, layers)
    assert unpinned is not None and (unpinned.layers, unpinned.why) == (
        1, "no registry digest of base is known here (built or loaded on this machine, never pulled or pushed)")
