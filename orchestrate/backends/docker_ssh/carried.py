"""An image carried to an allocator's allocation through the storage its nodes share (`submit`).

`submit` runs where the image was built; the batch job's `up` runs on the allocation's first node, whose Docker
lacks it. So, before sbatch, `submit` writes the image's compressed layer blobs into a store on the shared storage
(content-addressed: a blob already there is not written again, so a rebuild after a code change writes one small
layer) and a manifest naming them; the batch job's `up --image-from MANIFEST` loads on its node the layers that
node's Docker lacks (layercache.archive: `docker load` never reads a held layer's file), each blob's sha256 checked
as it is read, then sends the other nodes theirs as every `up` does (image.py). Nothing but the shared storage
the site already has: no registry on or for the nodes.

The blobs are the local layer cache's (layercache.py: only new layers are compressed); the store is
    STORE/blobs/sha256/<hex>            a layer blob (gzip tar) or the image config
    STORE/manifests/<image-id-hex>.json {"name": tag, "config": image ID, "layers": [{"digest", "size"}, ...]}
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from orchestrate.backends.docker_ssh.layercache import (
    CHUNK,
    Blob,
    CachedImage,
    LayerCache,
    archive,
    fill_cache,
    open_cache,
)
from orchestrate.backends.docker_ssh.observe import node_chain_ids
from orchestrate.backends.docker_ssh.savetar import load_name
from orchestrate.backends.docker_ssh.sendlayers import DeltaLoadError
from orchestrate.errors import ConfigError, OrchestrateError
from orchestrate.localfs import write_atomically
from orchestrate.probe.layers import held_prefix


class CarriedError(OrchestrateError):
    """The carried image cannot be read or loaded on this node (a blob missing or corrupt, a refused load)."""

    exit_code = 1


@dataclass(frozen=True)
class Carried:
    """A carried image as its manifest names it: the tag to load, its ID (the config's sha256) and layer blobs."""

    name: str
    image_id: str
    layers: tuple[Blob, ...]

    def to_json(self) -> bytes:
        return json.dumps({"name": self.name, "config": self.image_id,
                           "layers": [{"digest": b.digest, "size": b.size} for b in self.layers]}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: Path) -> Carried:
        try:
            doc = json.loads(raw)
            return cls(str(doc["name"]), str(doc["config"]),
                       tuple(Blob(str(b["digest"]), int(b["size"])) for b in doc["layers"]))
        except (ValueError, KeyError, TypeError) as err:
            raise CarriedError(f"--image-from {where}: not a manifest written by submit ({err})") from None


def blob_path(store: Path, digest: str) -> Path:
    return store / "blobs" / "sha256" / digest.split(":", 1)[1]


def manifest_path(store: Path, image_id: str) -> Path:
    return store / "manifests" / f"{image_id.split(':', 1)[1]}.json"


def store_of(manifest: Path) -> Path:
    return manifest.parent.parent


# ---- where submit runs: the blobs written to the store --------------------------------------------------------


def local_image_id(name: str) -> str | None:
    """The image's ID in this machine's Docker; None when it has no such image (or there is no Docker here)."""
    import docker
    import docker.errors

    try:
        return str(docker.from_env(timeout=600).images.get(name).id)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.DockerException as err:
        raise ConfigError(f"--image {name}: cannot read this machine's Docker to carry the image ({err}); start it, "
                          "or pass --pull to have the nodes pull it") from None


def refusal(layer_cache: str, registry_here: bool) -> str | None:
    """PURE: why the image built here cannot be carried (None: it can): its blobs are the local layer cache's."""
    if layer_cache == "off":
        return ("submit: the image is carried to the nodes as the local layer cache's blobs; leave out "
                "--layer-cache off, or pass --pull to have the nodes pull it")
    if not registry_here:
        return ("submit: carrying the image built here to the nodes needs the local layer cache's docker-registry; "
                "install it (Debian: apt-get install docker-registry), or pass --pull to have the nodes pull it")
    return None


def write(name: str, image_id: str, store: Path, console: Console) -> Path:
    """Put the image's blobs the store lacks there, then its manifest; returns the manifest's path. Lines go to
    `console` (submit prints its job ID alone on stdout)."""
    import docker

    local = docker.from_env(timeout=600)
    image = local.images.get(image_id)
    with ExitStack() as stack, Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                        TransferSpeedColumn(), console=console, transient=True) as bars:
        cache = open_cache("on", name, console, stack)  # refusal() has said why it could not be used
        assert cache is not None  # mode "on": a failure raised
        cached = fill_cache(cache, local, image_id, len(image.attrs["RootFS"]["Layers"]), name, "on", console, bars)
        assert cached is not None
        written = _put_blobs(cache, cached, store)
    carried = Carried(load_name(image, name) or name, image_id, cached.layers)
    path = manifest_path(store, image_id)
    write_atomically(path, [carried.to_json()])
    there = len(cached.layers) - written[0]
    console.print(f"image {name}: {written[0]} of {len(cached.layers)} layers ({written[1] / 1e6:.2f} MB) written to "
                  f"{store} for the nodes" + (f" ({there} already there)" if there else ""), markup=False,
                  highlight=False, soft_wrap=True)
    return path


def _put_blobs(cache: LayerCache, cached: CachedImage, store: Path) -> tuple[int, int]:
    """Copy into the store the blobs it lacks (a file of the right size counts as there: the node checks its
    digest as it reads it); returns (layers written, bytes written)."""
    config = blob_path(store, "sha256:" + hashlib.sha256(cached.config).hexdigest())
    if not config.exists():
        write_atomically(config, [cached.config])
    layers = bytes_written = 0
    for blob in cached.layers:
        path = blob_path(store, blob.digest)
        if path.exists() and path.stat().st_size == blob.size:
            continue
        write_atomically(path, checked(cache.blob_chunks(blob), blob))
        layers, bytes_written = layers + 1, bytes_written + blob.size
    return layers, bytes_written


def checked(chunks: Iterator[bytes], blob: Blob) -> Iterator[bytes]:
    """The chunks of `blob` as they come, the last one held back until the whole has the digest its name says:
    a reader (a file being written, a `docker load`) never gets the end of a corrupt blob."""
    digest, held = hashlib.sha256(), b""
    for chunk in chunks:
        digest.update(chunk)
        if held:
            yield held
        held = chunk
    if "sha256:" + digest.hexdigest() != blob.digest:
        raise CarriedError(f"blob {blob.digest[:19]}: its content has sha256:{digest.hexdigest()[:12]}; submit the "
                           "job again to write it anew")
    if held:
        yield held


# ---- on the allocation's first node: loaded from the store -------------------------------------------------


def load(manifest: Path, image: str, console: Console) -> None:
    """Load the carried image into this machine's Docker, only the layers it lacks; nothing when it holds it."""
    import docker

    try:
        carried = Carried.from_json(manifest.read_bytes(), manifest)
    except OSError as err:
        raise CarriedError(f"--image-from {manifest}: {err.strerror}; it is written by submit on storage every "
                           "node sees (--layer-store)") from None
    if carried.name != image and load_name_of(image) != carried.name:
        raise ConfigError(f"--image-from {manifest} carries {carried.name}, not --image {image}")
    local = docker.from_env(timeout=3600)
    if any(img.id == carried.image_id for img in local.images.list(name=carried.name)):
        return
    store = store_of(manifest)
    config = b"".join(checked(_read(store, Blob(carried.image_id, -1)), Blob(carried.image_id, -1)))
    diff_ids = json.loads(config)["rootfs"]["diff_ids"]
    keep_from = held_prefix(diff_ids, node_chain_ids(local))
    cached = CachedImage(config, carried.layers)
    sent = [0]

    def counted(chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            sent[0] += len(chunk)
            yield chunk

    def blobs(blob: Blob) -> Iterator[bytes]:
        return checked(_read(store, blob), blob)

    _docker_load(local, counted(archive(cached, carried.name, keep_from, blobs)))
    if local.images.get(carried.name).id != carried.image_id:
        raise CarriedError(f"image {carried.name}: loaded from {manifest}, but it has another ID than "
                           f"{carried.image_id[:19]}")
    console.print(f"image {image} on {socket.gethostname()}: loaded {len(carried.layers) - keep_from} of "
                  f"{len(carried.layers)} layers ({sent[0] / 1e6:.2f} MB) from {store}", markup=False,
                  highlight=False, soft_wrap=True)


class Store:
    """The store's blobs as the layers the other nodes are sent (sendlayers.py's BlobSource), each checked as read."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def blob_chunks(self, blob: Blob) -> Iterator[bytes]:
        return checked(_read(self.root, blob), blob)


def source(manifest: Path | None, image_id: str | None) -> tuple[Store, CachedImage] | None:
    """The carried blobs as the source of the layers the other nodes lack, when `manifest` is of the image here:
    nothing is compressed again on the first node."""
    if manifest is None or image_id is None:
        return None
    carried = Carried.from_json(manifest.read_bytes(), manifest)
    if carried.image_id != image_id:
        return None
    store = Store(store_of(manifest))
    config = b"".join(store.blob_chunks(Blob(carried.image_id, -1)))
    return store, CachedImage(config, carried.layers)


def load_name_of(image: str) -> str:
    """The tag `docker load` gives a name without one (:latest)."""
    return image if "@" in image or ":" in image.rsplit("/", 1)[-1] else f"{image}:latest"


def _read(store: Path, blob: Blob) -> Iterator[bytes]:
    path = blob_path(store, blob.digest)
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
    except OSError as err:
        raise CarriedError(f"blob {path}: {err.strerror}; submit the job again to write it") from None


def _docker_load(local: Any, chunks: Iterator[bytes]) -> None:
    try:
        for event in local.api.load_image(chunks):
            if isinstance(event, dict) and event.get("error"):
                raise DeltaLoadError(f"docker load: {event['error']}")
    except DeltaLoadError as err:
        raise CarriedError(f"{err}") from None


def dry_run_line(name: str, image_id: str | None, store: Path) -> str:
    """What `submit` would write to the store, said without writing or compressing anything."""
    if image_id is None:
        return (f"# image {name}: not carried (not on this machine, or --pull): the nodes must hold it or pull it")
    path = manifest_path(store, image_id)
    try:
        there = Carried.from_json(path.read_bytes(), path)
        missing = [b for b in there.layers if not blob_path(store, b.digest).is_file()]
    except (OSError, CarriedError):
        missing = None
    if missing == []:
        return f"# image {name} ({image_id[:19]}): already in {store}; nothing written, the first node loads it"
    import docker

    image = docker.from_env(timeout=600).images.get(image_id)
    return (f"# image {name} ({image_id[:19]}, {len(image.attrs['RootFS']['Layers'])} layers, "
            f"{int(image.attrs.get('Size') or 0) / 1e6:.0f} MB uncompressed): before sbatch, its compressed layers "
            f"that {store} lacks are written there (from the local layer cache); the batch job's `up` loads on the "
            "first node the ones it lacks, and sends the other nodes theirs")
