"""The `docker save` stream cut per node: the layers a node holds left out, entry by entry, compressed once per
group of nodes that hold the same layers (sendlayers.py sends what this writes).

The `docker save` stream, how (Docker 20.10's `docker save` layout, checked on this machine):
    <config-sha>.json                     the image config
    <v1-id>/VERSION, <v1-id>/json         per layer: legacy metadata (small)
    <v1-id>/layer.tar                     per layer: the uncompressed layer (its sha256 is the layer's diff ID)
    manifest.json, repositories           last (entries are in name order)
`docker load` skips every layer whose chain ID the daemon already holds and never opens its layer.tar, so an
archive without those files loads (FIELD-NOTES). A node holds layer i when the chain ID of the image's first
i+1 diff IDs is among the chain IDs of its images' RootFS layers. Chain IDs nest, so what a node holds is a
prefix of the image's layers, and nodes that hold the same prefix share one filtered, compressed stream.

The v1 ID of a layer folder is a hash over its `json` (minus "id") and the layer's chain ID, so the folder's
`json`, which comes just before its layer.tar, says which layer it is. A layer that cannot be identified is sent.
Newer Docker (OCI layout: blobs/sha256/<diff-id>) names layers by diff ID directly; both are understood.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import tarfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.errors import SSHError
from orchestrate.probe.layers import chain_ids

log = logging.getLogger(__name__)
CHUNK = 1 << 20
QUEUE_CHUNKS = 16  # per node: bounded, so one local `save` stream moves at the pace of the slowest node
PUT_WAIT_S = 1.0


# ---- pure: which layer a save entry is ------------------------------------------------------------------


def _go_json(obj: dict[str, Any]) -> bytes:
    """Go's json.Marshal of a map: keys sorted, compact, <>& escaped (nested objects keep their order)."""
    text = json.dumps(dict(sorted(obj.items())), separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def v1_layer_index(folder: str, legacy_json: bytes, chains: Sequence[str]) -> int | None:
    """Which layer a `docker save` folder holds: the index whose chain ID reproduces the folder's v1 ID.

    Docker computes the v1 ID (daemon/images/tarexport, image/v1.CreateID) before adding "os" to all but the
    last layer's json, so both forms are tried.
    """
    try:
        meta = json.loads(legacy_json)
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    meta.pop("id", None)
    if meta.get("parent"):
        meta["parent"] = "sha256:" + meta["parent"]
    forms = [meta, {k: v for k, v in meta.items() if k != "os"}]
    for index, chain in enumerate(chains):
        for form in forms:
            if hashlib.sha256(_go_json({**form, "layer_id": chain})).hexdigest() == folder:
                return index
    return None


def oci_layer_index(path: str, diff_ids: Sequence[str]) -> int | None:
    """Newer `docker save` (OCI layout) stores an uncompressed layer as blobs/sha256/<diff ID>."""
    if not path.startswith("blobs/sha256/"):
        return None
    digest = "sha256:" + path.rsplit("/", 1)[-1]
    return diff_ids.index(digest) if digest in diff_ids else None


# ---- one save stream, filtered per group of nodes, compressed once per group ------------------------------


class Feed:
    """The compressed chunks for one node: a bounded queue the node's `docker load` request reads."""

    def __init__(self) -> None:
        self.chunks: queue.Queue[bytes | None] = queue.Queue(QUEUE_CHUNKS)
        self.closed = threading.Event()  # the node gave up: the producer stops waiting for it

    def put(self, chunk: bytes | None) -> None:
        while not self.closed.is_set():
            try:
                self.chunks.put(chunk, timeout=PUT_WAIT_S)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[bytes]:
        while (chunk := self.chunks.get()) is not None:
            yield chunk


@dataclass
class Sink:
    """A filtered archive for the nodes that hold the first `keep_from` layers: tar + gzip, written once."""

    keep_from: int
    feeds: list[Feed]
    sent: int = 0  # compressed bytes
    layers_sent: int = 0
    packer: Any = field(default_factory=lambda: zlib.compressobj(3, zlib.DEFLATED, 31))
    buffered: bytearray = field(default_factory=bytearray)

    def write(self, data: bytes | memoryview) -> None:
        self.buffered += self.packer.compress(data)
        if len(self.buffered) >= CHUNK:
            self._emit(bytes(self.buffered))
            self.buffered.clear()

    def finish(self) -> None:
        self.write(b"\0" * (2 * tarfile.BLOCKSIZE))  # end-of-archive marker
        self.buffered += self.packer.flush()
        self._emit(bytes(self.buffered))
        for feed in self.feeds:
            feed.put(None)

    def abort(self) -> None:
        for feed in self.feeds:
            feed.put(None)

    def _emit(self, chunk: bytes) -> None:
        if chunk:
            self.sent += len(chunk)
            for feed in self.feeds:
                feed.put(chunk)


class _Blocks:
    """Exact reads over the save stream's chunks, without joining what is only passed on."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._rest = memoryview(b"")
        self.total = 0

    def pieces(self, n: int) -> Iterator[memoryview]:
        """The next n bytes, as they arrive (the caller uses each piece before asking for the next)."""
        while n > 0:
            if not self._rest:
                try:
                    self._rest = memoryview(next(self._chunks))
                except StopIteration:
                    raise ValueError("docker save stream ended inside an entry") from None
            piece, self._rest = self._rest[:n], self._rest[n:]
            self.total += len(piece)
            n -= len(piece)
            yield piece

    def read(self, n: int) -> bytes:
        return b"".join(bytes(p) for p in self.pieces(n))

    def drain(self) -> int:
        """Read to the end (the archive's zero padding); return the stream's size."""
        self.total += len(self._rest) + sum(len(c) for c in self._chunks)
        self._rest = memoryview(b"")
        return self.total


def _padded(size: int) -> int:
    return size + (-size % tarfile.BLOCKSIZE)


def _long_name(kind: bytes, data: bytes) -> str | None:
    """The name a GNU long-name ('L') or pax ('x') header gives the next entry, if any."""
    if kind == tarfile.GNUTYPE_LONGNAME:
        return data.rstrip(b"\0").decode("utf-8", "surrogateescape")
    for record in data.decode("utf-8", "surrogateescape").splitlines():
        _, _, keyval = record.partition(" ")
        key, _, value = keyval.partition("=")
        if key == "path":
            return value
    return None


def filter_save(chunks: Iterator[bytes], diff_ids: Sequence[str], sinks: Sequence[Sink]) -> int:
    """Copy a `docker save` stream into every sink, leaving out each sink's held layers; return its size.

    Entries are copied byte for byte (header, data, padding); only the decision per entry needs parsing.
    Long-name headers travel with the entry they name.
    """
    chains = chain_ids(diff_ids)
    stream = _Blocks(chunks)
    folder_index: dict[str, int | None] = {}
    prefix = b""  # pax / GNU long-name headers of the next entry
    name_override: str | None = None
    while True:
        header = stream.read(tarfile.BLOCKSIZE)
        if header.count(0) == tarfile.BLOCKSIZE:
            return stream.drain()  # end of archive
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        size = info.size if info.type in tarfile.REGULAR_TYPES or info.type in (
            tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) else 0
        if info.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME):
            data = stream.read(_padded(size))
            name_override = _long_name(info.type, data[:size]) or name_override
            prefix += header + data
            continue
        name = (name_override or info.name).lstrip("./")
        folder, _, base = name.rpartition("/")
        is_layer = base == "layer.tar" or name.startswith("blobs/sha256/")
        index = folder_index.get(folder) if base == "layer.tar" else (
            oci_layer_index(name, diff_ids) if is_layer else None)
        if is_layer and index is None and base == "layer.tar":
            log.info("save entry %s: layer not identified, sent to every node", name)
        targets = [s for s in sinks if not (is_layer and index is not None and index < s.keep_from)]
        for sink in targets:
            sink.write(prefix + header)
            if base == "layer.tar" or (is_layer and index is not None):
                sink.layers_sent += 1
        prefix, name_override = b"", None
        if base == "json" and folder and size < 1 << 20:
            data = stream.read(_padded(size))
            folder_index[folder] = v1_layer_index(folder, data[:size], chains)
            for sink in targets:
                sink.write(data)
            continue
        for piece in stream.pieces(_padded(size)):
            for sink in targets:
                sink.write(piece)


def load_name(image: Any, name: str) -> str | None:
    """The tag the node's `docker load` gives the image: `name` itself when the image has it (a name without a
    tag means :latest), else its first tag (docker-py's save(named=True) would always take the first one)."""
    tagged = name if "@" in name or ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    tags = list(image.tags)
    return tagged if tagged in tags else (tags[0] if tags else None)


def saved_archive(local: Any, name: str, keep_from: int) -> Iterator[bytes]:
    """One `docker save` stream as a `docker load` archive without the first `keep_from` layers (gzip)."""
    image = local.images.get(name)
    feed = Feed()
    sink = Sink(keep_from, [feed])
    failed: list[BaseException] = []

    def produce() -> None:
        try:
            filter_save(image.save(named=load_name(image, name) or False, chunk_size=CHUNK),
                        list(image.attrs["RootFS"]["Layers"]), [sink])
            sink.finish()
        except BaseException as err:
            failed.append(err)
            sink.abort()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        yield from feed
    finally:
        feed.closed.set()
        thread.join()
    if failed:
        raise SSHError(f"docker save of {name} here failed: {failed[0]}")
