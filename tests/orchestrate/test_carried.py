"""The image `submit` carries through the shared storage (backends/docker_ssh/carried.py): its manifest, and the
digest check that keeps a corrupt blob's end from a reader. The carrying itself runs on the real Slurm:
tests/cluster/test_slurm_backend.py::test_submit_brings_an_image_the_nodes_lack_through_the_shared_storage."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orchestrate.backends.docker_ssh.carried import (
    Carried,
    CarriedError,
    blob_path,
    checked,
    dry_run_line,
    manifest_path,
    refusal,
    store_of,
)
from orchestrate.backends.docker_ssh.layercache import Blob
from orchestrate.localfs import write_atomically


def blob_of(data: bytes) -> Blob:
    return Blob("sha256:" + hashlib.sha256(data).hexdigest(), len(data))


def test_the_manifest_round_trips_and_lives_beside_the_blobs(tmp_path: Path) -> None:
    carried = Carried("img:1", "sha256:" + "c" * 64, (blob_of(b"a"), blob_of(b"bb")))
    path = manifest_path(tmp_path, carried.image_id)
    assert Carried.from_json(carried.to_json(), path) == carried
    assert store_of(path) == tmp_path
    assert blob_path(tmp_path, carried.layers[0].digest).parent == tmp_path / "blobs" / "sha256"


def test_a_file_that_is_not_a_manifest_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CarriedError, match=r"--image-from .*x\.json: not a manifest written by submit"):
        Carried.from_json(b'{"name": "img"}', tmp_path / "x.json")


def test_a_blob_passes_whole_and_a_corrupt_one_never_gives_its_last_chunk() -> None:
    good = [b"one", b"two", b"three"]
    assert list(checked(iter(good), blob_of(b"".join(good)))) == good
    got: list[bytes] = []
    with pytest.raises(CarriedError, match=r"blob sha256:.* its content has sha256:"):
        for chunk in checked(iter([b"one", b"two", b"tampered"]), blob_of(b"".join(good))):
            got.append(chunk)
    assert got == [b"one", b"two"]  # the reader (docker load, a file) never sees the archive complete


def test_the_dry_run_says_nothing_is_written_when_the_store_holds_every_blob(tmp_path: Path) -> None:
    layer = b"layer"
    carried = Carried("img:1", "sha256:" + "c" * 64, (blob_of(layer),))
    assert "not carried" in dry_run_line("img:1", None, tmp_path)
    write_atomically(manifest_path(tmp_path, carried.image_id), [carried.to_json()])
    write_atomically(blob_path(tmp_path, carried.layers[0].digest), [layer])
    assert dry_run_line("img:1", carried.image_id, tmp_path) == (
        f"# image img:1 ({carried.image_id[:19]}): already in {tmp_path}; nothing written, the first node loads it")


@pytest.mark.parametrize(("layer_cache", "registry_here", "needle"), [
    ("off", True, "leave out --layer-cache off, or pass --pull"),
    ("auto", False, "install it (Debian: apt-get install docker-registry), or pass --pull"),
    ("on", False, "install it (Debian: apt-get install docker-registry), or pass --pull"),
    ("auto", True, None),
])
def test_the_image_is_carried_only_through_the_layer_cache_else_submit_says_what_to_do(
        layer_cache: str, registry_here: bool, needle: str | None) -> None:
    said = refusal(layer_cache, registry_here)
    assert said == needle if needle is None else (said and said.startswith("submit: ") and needle in said)
