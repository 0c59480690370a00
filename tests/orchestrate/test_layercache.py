"""The local layer cache (orchestrate/backends/docker_ssh/layercache.py): the archive it writes for `docker load`, the manifest check,
and, against the real local dockerd and Debian's docker-registry, that a push stores only new layers and that an
archive holding only the new layer loads into a daemon holding the rest.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import signal
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.lines import LineReader

from devcluster.tinyimage import TINY_IMAGE, load_tiny_image
from orchestrate.backends.docker_ssh.layercache import (
    Blob,
    CachedImage,
    LayerCache,
    LayerCacheError,
    archive,
    layer_path,
    one_filler,
    parse_manifest,
    registry_binary,
)

CONFIG = b'{"rootfs": {"type": "layers"}}'
IMAGE_ID = "sha256:" + hashlib.sha256(CONFIG).hexdigest()


def _blobs(*contents: bytes) -> tuple[dict[str, bytes], CachedImage]:
    store = {"sha256:" + hashlib.sha256(c).hexdigest(): c for c in contents}
    return store, CachedImage(CONFIG, tuple(Blob(d, len(c)) for d, c in store.items()))


def _read(chunks: Iterator[bytes]) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_the_archive_lists_every_layer_but_holds_only_those_the_node_lacks() -> None:
    store, image = _blobs(b"base" * 1000, b"deps" * 333, b"trainer")
    files = _read(archive(image, "img:new", 2, lambda b: iter([store[b.digest]])))
    manifest = json.loads(files.pop("manifest.json"))
    assert manifest == [{"Config": IMAGE_ID[7:] + ".json", "RepoTags": ["img:new"],
                         "Layers": [layer_path(b) for b in image.layers]}]
    assert files.pop(IMAGE_ID[7:] + ".json") == CONFIG
    assert files == {layer_path(image.layers[2]): b"trainer"}  # the blob as cached: no recompression
    assert image.total == len(CONFIG) + 4000 + 1332 + 7


def test_a_blob_shorter_than_its_manifest_says_stops_the_archive() -> None:
    store, image = _blobs(b"base" * 1000)
    with pytest.raises(LayerCacheError, match="has 10 bytes, its manifest says 4000"):
        b"".join(archive(image, "img:new", 0, lambda b: iter([store[b.digest][:10]])))


def test_a_manifest_for_another_image_or_layer_count_is_refused() -> None:
    raw = json.dumps({"config": {"digest": IMAGE_ID}, "layers": [{"digest": "sha256:" + "a" * 64, "size": 3}]})
    assert parse_manifest(raw.encode(), IMAGE_ID, 1) == (IMAGE_ID, (Blob("sha256:" + "a" * 64, 3),))
    with pytest.raises(LayerCacheError, match="with 1 layers, the image is"):
        parse_manifest(raw.encode(), IMAGE_ID, 2)
    with pytest.raises(LayerCacheError, match="unreadable manifest"):
        parse_manifest(b"{}", IMAGE_ID, 1)


def test_a_registry_that_does_not_start_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LayerCacheError, match="/bin/false did not start"), LayerCache.started("/bin/false",
                                                                                             tmp_path / "layers"):
        pass


# ---- the real registry and dockerd ------------------------------------------------------------------------


def _pushed(cache: LayerCache, client: docker.DockerClient, tag: str) -> tuple[CachedImage, int]:
    events: list[dict] = []
    image = client.images.get(tag)
    cached = cache.put(client, str(image.id), len(image.attrs["RootFS"]["Layers"]), events.append)
    return cached, sum(e.get("status") == "Pushed" for e in events)


@pytest.mark.docker
def test_a_push_stores_only_new_layers_and_their_blobs_load_on_a_daemon_holding_the_rest(
        docker_client: docker.DockerClient, tmp_path: Path) -> None:
    binary = registry_binary()
    if binary is None:
        pytest.fail("docker-registry is missing: apt-get install docker-registry", pytrace=False)
    load_tiny_image(docker_client)
    child = f"layercache-test:{uuid.uuid4().hex[:8]}"
    docker_client.images.build(fileobj=io.BytesIO(f"FROM {TINY_IMAGE}\nRUN echo {child} > /marker\n".encode()),
                               tag=child, rm=True)
    try:
        with LayerCache.started(binary, tmp_path / "layers") as cache:
            parent, new = _pushed(cache, docker_client, TINY_IMAGE)
            assert new == len(parent.layers) >= 1  # an empty cache takes every layer
            cached, new = _pushed(cache, docker_client, child)
            assert new == 1 and cached.layers[:-1] == parent.layers
        assert not [t for t in docker_client.images.get(child).tags if "127.0.0.1" in t]  # the push tag is gone
        with LayerCache.started(binary, tmp_path / "layers") as again:  # another port, the same storage
            assert _pushed(again, docker_client, child)[1] == 0
            delta = b"".join(archive(cached, child, len(parent.layers), again.blob_chunks))
        child_id = docker_client.images.get(child).id
        docker_client.images.remove(child)  # the daemon now holds only the parent's layers
        assert len(delta) < 10_000
        docker_client.images.load(delta)
        assert docker_client.images.get(child).id == child_id
    finally:
        try:
            docker_client.images.remove(child)
        except docker.errors.ImageNotFound:
            pass


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_cache_that_cannot_start_falls_back_to_docker_save_unless_required(
        mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import ExitStack

    from rich.console import Console

    import orchestrate.backends.docker_ssh.layercache as layercache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(layercache, "registry_binary", lambda: "/bin/false")
    console = Console(record=True, width=200, emoji=False)  # as the CLI's
    with ExitStack() as stack:
        if mode == "on":
            with pytest.raises(LayerCacheError, match="did not start"):
                layercache.open_cache(mode, "img:new", console, stack)
        else:
            assert layercache.open_cache(mode, "img:new", console, stack) is None
            assert console.export_text() == ("image img:new: layer cache: /bin/false did not start: exit code 1; "
                                             "sending from docker save instead\n")


def test_the_registry_ends_with_the_process_that_started_it_even_on_sigkill(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time
    import urllib.request

    binary = registry_binary()
    if binary is None:
        pytest.fail("docker-registry is missing: apt-get install docker-registry", pytrace=False)
    script = ("import sys, time; from pathlib import Path; from orchestrate.backends.docker_ssh.layercache import LayerCache\n"
              "with LayerCache.started(sys.argv[1], Path(sys.argv[2])) as cache:\n"
              "    print(cache.port, flush=True); time.sleep(600)\n")
    up = subprocess.Popen([sys.executable, "-c", script, binary, str(tmp_path / "layers")], stdout=subprocess.PIPE,
                          text=True)
    url = f"http://127.0.0.1:{int(LineReader(up.stdout).next(60, 'the layer cache to start'))}/v2/"
    with urllib.request.urlopen(url, timeout=5) as res:
        assert res.status == 200
    up.kill()
    up.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
        except OSError:
            return  # nothing answers: the registry is gone
        time.sleep(0.1)
    pytest.fail("the registry still answers 15 s after its `up` was killed")


def _held_by_another_process(root: Path) -> subprocess.Popen[bytes]:
    """Another `up` pushing: a process holding the fill lock (util-linux flock), until it is killed."""
    root.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(["flock", "--exclusive", "--close", str(root / ".fill.lock"), "sleep", "600"],
                              start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with one_filler(root, 0):
                pass
        except LayerCacheError:
            return holder
        time.sleep(0.05)  # not held yet: flock starts in a moment
    _kill(holder)
    pytest.fail("the flock process did not take the lock within 10 s")


def _kill(holder: subprocess.Popen[bytes]) -> None:
    os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep
    holder.wait(timeout=10)


def test_a_push_waits_for_another_ups_push_into_the_same_cache_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "layers"
    holder = _held_by_another_process(root)
    try:
        with caplog.at_level(logging.WARNING, "orchestrate.backends.docker_ssh.layercache"), pytest.raises(LayerCacheError) as err:
            with one_filler(root, 0.6):
                pytest.fail("entered while another process held the lock")
        assert str(root) in str(err.value)
        assert [r.getMessage() for r in caplog.records].count(
            "layer cache: another `up` is filling it; waiting for its layers (at most 1 s)") == 1
    finally:
        _kill(holder)  # SIGKILL: the kernel releases a dead holder's lock
    with one_filler(root, 5):
        pass
