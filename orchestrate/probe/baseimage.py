"""The image's base, and whether a node can pull it itself (read-only: nothing is pulled to learn it).

The image records its base with OCI's annotations as labels (the Dockerfile): `org.opencontainers.image.base.name`
(the BASE_IMAGE it was built FROM) and `.base.digest` (its manifest digest, where `make image` knew it). A node
pulls the base only by digest, so that it gets exactly the layers the image was built on: where the label gives
none, the local base's registry digests (RepoDigests, from its pull or push) may; a base built or loaded here has
none, and its layers are then sent as before.

Whether a node can pull it is asked of the node's own daemon, and the local base is read, by the scheduler
(`Daemons.registry_reach`, `Daemons.local_layers`; Docker's: backends/docker_ssh/observe.py); here is what its
answers mean.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrate.probe.observations import LocalBase

BASE_NAME_LABEL = "org.opencontainers.image.base.name"
BASE_DIGEST_LABEL = "org.opencontainers.image.base.digest"


def repository(name: str) -> str:
    """PURE: the name without its tag or digest ("nvcr.io/nvidia/pytorch:26.08-py3" -> "nvcr.io/nvidia/pytorch";
    a registry's port is not a tag)."""
    name = name.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _familiar(repo: str) -> str:
    """Docker Hub's long form as Docker prints it ("docker.io/library/ubuntu" -> "ubuntu")."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if repo.startswith(prefix):
            return repo[len(prefix):]
    return repo


def pinned_ref(name: str, label_digest: str, repo_digests: Sequence[str]) -> str | None:
    """PURE: the base's name pinned to its manifest digest ("repo@sha256:..."): the label's digest, else the local
    base's registry digest for the same repository; None when neither is known."""
    repo = repository(name)
    if label_digest:
        return f"{repo}@{label_digest}"
    for entry in repo_digests:
        found, _, digest = entry.partition("@")
        if digest and _familiar(found) == _familiar(repo):
            return f"{repo}@{digest}"
    return None


def base_of(name: str, label_digest: str, diff_ids: Sequence[str],
            found: tuple[Sequence[str], Sequence[str]] | None) -> LocalBase:
    """PURE: the base `name` the local image records and what the nodes may pull of it, from the local base `found`
    here ((its layers, its RepoDigests); None: no such image here)."""
    if found is None:
        return LocalBase(name, 0, name, f"{name} is not on this machine, so which layers are its own is not known")
    layers, repo_digests = list(found[0]), found[1]
    if list(diff_ids[:len(layers)]) != layers:
        return LocalBase(name, 0, name, f"{name} on this machine is not the base the image was built on")
    ref = pinned_ref(name, label_digest, repo_digests)
    if ref is None:
        return LocalBase(name, len(layers), name, f"no registry digest of {name} is known here (built or loaded on "
                                                  "this machine, never pulled or pushed)")
    return LocalBase(name, len(layers), ref)
