"""Give every node the job's image, sending only the layers its daemon lacks.

The layers come from the local layer cache (layercache.py: the cached compressed blobs, nothing read or
compressed but the new layers) when `--layer-cache` allows it, else from one `docker save` stream filtered here.

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from orchestrate.backends.docker_ssh.layercache import (
    REGISTRY_BINARY,
    Blob,
    CachedImage,
    LayerCache,
    LayerCacheError,
    archive,
    cache_dir,
    registry_binary,
)
from orchestrate.backends.docker_ssh.relay import (
    RelayError,
    fallback_line,
    relay,
    relay_address,
    relayed_line,
)
from orchestrate.errors import SSHError
from orchestrate.plan.jobplan import JobPlan
from orchestrate.plan.relay import RelayPlan, plan_relay
from orchestrate.probe.layers import chain_ids
from orchestrate.remote.docker import image_id
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import fan_out

log = logging.getLogger(__name__)
CHUNK = 1 << 20
QUEUE_CHUNKS = 16  # per node: bounded, so one local `save` stream moves at the pace of the slowest node
PUT_WAIT_S = 1.0


class DeltaLoadError(SSHError):
    """`docker load` of a layer delta failed on a node (the caller then sends the full archive)."""


# ---- pure: chain IDs, which layers a node holds, which layer a save entry is ----------------------------


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


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def summary_line(name: str, label: str, sent: int, layers_sent: int, layers: int, total: int) -> str:
    """The per-node line the tests and the benchmark read: sent N MB (k of m layers) of T MB."""
    return (f"image {name} on {label}: sent {sent / 1e6:.2f} MB ({layers_sent} of {_plural(layers, 'layer')}) "
            f"of {total / 1e6:.0f} MB")


# ---- one save stream, filtered per group of nodes, compressed once per group ------------------------------


class _Feed:
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
class _Sink:
    """A filtered archive for the nodes that hold the first `keep_from` layers: tar + gzip, written once."""

    keep_from: int
    feeds: list[_Feed]
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


def filter_save(chunks: Iterator[bytes], diff_ids: Sequence[str], sinks: Sequence[_Sink]) -> int:
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


# ---- apply -------------------------------------------------------------------------------------------


@dataclass
class Delivery:
    """What one node got: compressed bytes sent, layers sent of the image's layers, the full archive's size."""

    action: str  # "present" | "sent" | "relayed" (fetched from the relay node) | "pulled"
    sent: int = 0
    layers_sent: int = 0
    layers: int = 0
    total: int = 0
    fallback: str = ""  # why the delta was replaced by the full archive ("" when it was not)
    via: str = ""  # "relayed": the relay node it fetched the layers from


def load_name(image: Any, name: str) -> str | None:
    """The tag the node's `docker load` gives the image: `name` itself when the image has it (a name without a
    tag means :latest), else its first tag (docker-py's save(named=True) would always take the first one)."""
    tagged = name if "@" in name or ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    tags = list(image.tags)
    return tagged if tagged in tags else (tags[0] if tags else None)


def _load(nodes: Session, rank: int, chunks: Iterable[bytes], bars: Progress, task: Any) -> None:
    """One node's `docker load` of an archive arriving as `chunks`; a refusal raises DeltaLoadError."""
    client = nodes.docker(rank, timeout=3600)

    def counted() -> Iterator[bytes]:
        for chunk in chunks:
            bars.advance(task, len(chunk))
            yield chunk

    for event in client.api.load_image(counted()):
        if isinstance(event, dict) and event.get("error"):
            raise DeltaLoadError(f"docker load: {event['error']}")


def _bars(nodes: Session, ranks: Sequence[int], bars: Progress) -> dict[int, Any]:
    return {r: bars.add_task(f"image -> {nodes.hosts[r].label}", total=None) for r in ranks}


def send_layers(nodes: Session, ranks: Sequence[int], local: Any, name: str, held: dict[int, int],
                bars: Progress) -> dict[int, Delivery]:
    """One local save stream, filtered per distinct held prefix, loaded on every node in `ranks` in parallel."""
    image = local.images.get(name)
    diff_ids = list(image.attrs["RootFS"]["Layers"])
    feeds = {r: _Feed() for r in ranks}
    sinks = [_Sink(p, [feeds[r] for r in ranks if held[r] == p]) for p in sorted({held[r] for r in ranks})]
    tasks = _bars(nodes, ranks, bars)
    total = [0]
    errors: dict[int, BaseException] = {}

    def produce() -> None:
        try:
            total[0] = filter_save(image.save(named=load_name(image, name) or False, chunk_size=CHUNK), diff_ids,
                                   sinks)
            for sink in sinks:
                sink.finish()
        except BaseException:
            for sink in sinks:
                sink.abort()
            raise

    def consume(rank: int) -> None:
        try:
            _load(nodes, rank, feeds[rank], bars, tasks[rank])
        except BaseException as err:
            errors[rank] = err
        finally:
            feeds[rank].closed.set()

    threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    try:
        produce()
    finally:
        for t in threads:
            t.join()
    out: dict[int, Delivery] = {}
    for sink in sinks:
        for r in ranks:
            if held[r] == sink.keep_from:
                out[r] = Delivery("sent", sink.sent, sink.layers_sent, len(diff_ids), total[0])
    for rank, err in errors.items():
        out[rank].fallback = str(err) or type(err).__name__
    return out


def send_cached(nodes: Session, ranks: Sequence[int], cache: BlobSource, cached: CachedImage, name: str | None,
                held: dict[int, int], bars: Progress) -> dict[int, Delivery]:
    """Each node in `ranks` loads an archive of the cached blobs of the layers it lacks, all in parallel."""
    tasks = _bars(nodes, ranks, bars)
    out = {r: Delivery("sent", 0, len(cached.layers) - held[r], len(cached.layers), cached.total) for r in ranks}

    def one(rank: int) -> None:
        def counted() -> Iterator[bytes]:
            for chunk in archive(cached, name, held[rank], cache.blob_chunks):
                out[rank].sent += len(chunk)
                yield chunk

        try:
            _load(nodes, rank, counted(), bars, tasks[rank])
        except BaseException as err:
            out[rank].fallback = str(err) or type(err).__name__

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class _Pushed:
    """`docker push` progress as one bar (bytes of the layers being compressed and stored) and a count of the
    layers the cache gained."""

    def __init__(self, bars: Progress, name: str) -> None:
        self.bars, self.task = bars, bars.add_task(f"image {name} -> local layer cache", total=None)
        self.layers: dict[str, tuple[int, int]] = {}
        self.new = 0

    def __call__(self, event: dict[str, Any]) -> None:
        detail, layer = event.get("progressDetail") or {}, str(event.get("id", ""))
        if event.get("status") == "Pushed":
            self.new += 1
        if detail.get("total"):
            self.layers[layer] = (int(detail.get("current", 0)), int(detail["total"]))
            self.bars.update(self.task, completed=sum(c for c, _ in self.layers.values()),
                             total=sum(t for _, t in self.layers.values()))


def _cache_failed(err: LayerCacheError, mode: str, name: str, console: Console) -> None:
    if mode == "on":
        raise err
    console.print(f"image {name}: {err}; sending from docker save instead", markup=False, highlight=False)


def open_cache(mode: str, name: str, console: Console, stack: ExitStack) -> LayerCache | None:
    """The running local layer cache (`--layer-cache`), or None to use `docker save` (the reason printed).

    Called on the main thread: the registry is told to die with the thread that started it (layercache.py)."""
    binary = registry_binary()
    if mode == "off" or (binary is None and mode == "auto"):
        return None
    try:
        if binary is None:
            raise LayerCacheError(f"layer cache: {REGISTRY_BINARY} is not installed here")
        return stack.enter_context(LayerCache.started(binary, cache_dir()))
    except LayerCacheError as err:
        _cache_failed(err, mode, name, console)
        return None


def fill_cache(cache: LayerCache, local: Any, local_id: str, layers: int, name: str, mode: str, console: Console,
               bars: Progress) -> CachedImage | None:
    """Push the image into the cache; None (the reason printed) when that fails."""
    pushed = _Pushed(bars, name)
    try:
        cached = cache.put(local, local_id, layers, pushed)
    except LayerCacheError as err:
        _cache_failed(err, mode, name, console)
        return None
    console.print(f"image {name}: local layer cache has it ({_plural(pushed.new, 'new layer')} of "
                  f"{len(cached.layers)}, {cached.total / 1e6:.0f} MB compressed)", markup=False, highlight=False)
    return cached


class BlobSource(Protocol):
    """Where cached layer blobs are read: the local layer cache, or the store `submit` wrote (carried.py)."""

    def blob_chunks(self, blob: Blob) -> Iterator[bytes]:
        ...


Source = tuple[BlobSource, CachedImage]


def deliver(nodes: Session, held: Mapping[int, int], local: Any, local_id: str, name: str, console: Console,
            layer_cache: str = "off", settled: Callable[[], Mapping[int, int]] | None = None,
            blobs: Source | None = None, relay_mode: str = "off", relay_at: str = "") -> dict[int, Delivery]:
    """Send each node in `held` the layers it lacks (the plan's: how many leading layers it holds); where a delta
    does not load, send the full archive.

    The layers come from the local layer cache (`layer_cache` auto/on, see layercache.py) or from one filtered
    `docker save` stream (the cache is filled first), or from `blobs` when given (the image's blobs already
    compressed: what `submit` carried). `settled`: what each node holds once the source is ready, when that may
    change meanwhile (the nodes pull the image's base while the cache fills). `relay_mode` (--relay) and
    `relay_at` (the rendezvous address:port, node 0's address as the nodes reach it): see relay.py.
    """
    image = local.images.get(name)
    diff_ids = list(image.attrs["RootFS"]["Layers"])
    ranks = list(held)
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool, Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            console=console, transient=True) as bars:
        cache = None if blobs else open_cache(layer_cache, name, console, stack)
        filling = pool.submit(fill_cache, cache, local, local_id, len(diff_ids), name, layer_cache, console,
                              bars) if cache else None
        cached = filling.result() if filling else None
        source: Source | None = blobs or ((cache, cached) if cache and cached else None)
        held = settled() if settled is not None else held

        def send(targets: Sequence[int], keep: dict[int, int]) -> dict[int, Delivery]:
            if source is None:
                return send_layers(nodes, targets, local, name, keep, bars)
            return send_cached(nodes, targets, *source, load_name(image, name), keep, bars)

        def archive_of(keep_from: int) -> Iterator[bytes]:
            if source is None:
                return saved_archive(local, name, keep_from)
            return archive(source[1], load_name(image, name), keep_from, source[0].blob_chunks)

        chosen = plan_relay(relay_mode, held)
        if chosen.relay is None:
            done = send(ranks, dict(held))
        else:
            done = send_relayed(nodes, chosen, dict(held), _counted(archive_of, bars, nodes.hosts[chosen.relay].label),
                                len(diff_ids), name, relay_at, console, send)
            if source is not None:  # the whole image compressed, as send_cached says it
                for rank in done:
                    done[rank].total = source[1].total
        for rank in ranks:
            if not done[rank].fallback and image_id(nodes.docker(rank), name) != local_id:
                done[rank].fallback = "the loaded image has another ID"
        retry = [r for r in ranks if done[r].fallback and held[r] > 0]
        for rank in retry:
            console.print(f"image {name} on {nodes.hosts[rank].label}: layer delta failed "
                          f"({done[rank].fallback}); sending the full image", markup=False, highlight=False)
        if retry:
            full = send(retry, dict.fromkeys(retry, 0))
            for rank in retry:
                full[rank].sent += done[rank].sent
                done[rank] = full[rank]
    failed = {nodes.hosts[r].label: done[r].fallback for r in ranks if done[r].fallback}
    if failed:
        raise SSHError("image transfer failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return done


def _counted(archive_of: Callable[[int], Iterator[bytes]], bars: Progress, label: str
             ) -> Callable[[int], Iterator[bytes]]:
    """The archives of `archive_of` with a progress bar while they go to the relay node."""
    def counted(keep_from: int) -> Iterator[bytes]:
        task = bars.add_task(f"image -> {label} (relay)", total=None)
        for chunk in archive_of(keep_from):
            bars.advance(task, len(chunk))
            yield chunk

    return counted


def saved_archive(local: Any, name: str, keep_from: int) -> Iterator[bytes]:
    """One `docker save` stream as a `docker load` archive without the first `keep_from` layers (gzip)."""
    image = local.images.get(name)
    feed = _Feed()
    sink = _Sink(keep_from, [feed])
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


def send_relayed(nodes: Session, chosen: RelayPlan, held: dict[int, int],
                 archive_of: Callable[[int], Iterator[bytes]], layers: int, name: str, relay_at: str,
                 console: Console, send: Callable[[Sequence[int], dict[int, int]], dict[int, Delivery]]
                 ) -> dict[int, Delivery]:
    """The archive once to the relay node, which serves it to the others; a node that cannot fetch it (or every
    node, when the relay node fails) is sent its layers from here, one line saying why."""
    assert chosen.relay is not None
    via = nodes.hosts[chosen.relay].label
    try:
        relayed = relay(nodes, chosen, archive_of(chosen.keep_from), relay_address(nodes, chosen.relay, relay_at))
    except RelayError as err:
        console.print(f"image {name}: the relay on {via} failed ({err}); sending each node its layers from here",
                      markup=False, highlight=False, soft_wrap=True)
        return send(list(held), held)
    done = {chosen.relay: Delivery("sent", relayed.sent, layers - chosen.keep_from, layers, relayed.sent)}
    done.update({r: Delivery("relayed", 0, layers - held[r], layers, relayed.sent, via=via)
                 for r in chosen.fetch})
    for rank, why in sorted(relayed.unfetched.items()):
        console.print(fallback_line(name, nodes.hosts[rank].label, via, why), markup=False, highlight=False,
                      soft_wrap=True)
    if relayed.unfetched:
        done.update(send(sorted(relayed.unfetched), {r: held[r] for r in relayed.unfetched}))
    return done


def _base_first(nodes: Session, plan: JobPlan, image: str, console: Console) -> dict[int, int]:
    """Where the plan says so, the node pulls the image's base from its registry; then, per node that gets layers
    sent, the first layer sent. A node that lacks the base and does not pull it, or whose pull fails, gets its
    layers sent: one line per reason says why, naming the nodes (before the pulls, or after a failed one)."""
    actions = {n.rank: n.image for n in plan.nodes if n.image.kind == "send"}
    _say(nodes, image, console, {r: f"base not pulled by the node: {a.base_why}; sending its layers"
                                 for r, a in actions.items() if a.base_why})
    failed = pull_bases(nodes, {r: a.pull_base for r, a in actions.items() if a.pull_base})
    _say(nodes, image, console, {r: f"pulling base {a.pull_base} failed ({failed[r]}); sending its layers"
                                 if r in failed else f"pulled base {a.pull_base} from its registry"
                                 for r, a in actions.items() if a.pull_base})
    return {r: a.layers_held if r in failed else a.sent_from for r, a in actions.items()}


def _say(nodes: Session, image: str, console: Console, lines: Mapping[int, str]) -> None:
    """One line per distinct outcome, naming the nodes it happened on."""
    grouped: dict[str, list[str]] = {}
    for rank in sorted(lines):
        grouped.setdefault(lines[rank], []).append(nodes.hosts[rank].label)
    for line, labels in grouped.items():
        console.print(f"image {image} on {', '.join(labels)}: {line}", markup=False, highlight=False, soft_wrap=True)


def pull_bases(nodes: Session, refs: Mapping[int, str]) -> dict[int, str]:
    """Each node pulls its base (by digest), all in parallel; returns why, per node where the pull failed."""
    failed: dict[int, str] = {}

    def one(rank: int) -> None:
        try:
            nodes.docker(rank, timeout=3600).images.pull(refs[rank])
        except Exception as err:  # any failure sends the base's layers instead: reported, never raised
            failed[rank] = str(err) or type(err).__name__

    fan_out("base pull", list(refs), one, lambda r: nodes.hosts[r].label)
    return failed


def ensure_images(nodes: Session, plan: JobPlan, local: Any, local_id: str | None, console: Console,
                  layer_cache: str = "off", blobs: Source | None = None) -> dict[str, Delivery]:
    """Give every node the image as the plan says: nothing, a pull, or the layers it lacks (after its base, pulled
    by the node itself where the plan says so); `blobs`: the image's compressed blobs, when they are at hand."""
    image = plan.nodes[0].container.image
    ranks = list(range(len(nodes.hosts)))
    result: dict[int, Delivery] = {r: Delivery("present") for r in ranks}
    pulls = [r for r in ranks if plan.nodes[r].image.kind == "pull"]
    fan_out("image pull", pulls, lambda r: nodes.docker(r, timeout=3600).images.pull(image),
            lambda r: nodes.hosts[r].label)
    result.update({r: Delivery("pulled") for r in pulls})
    sends = {n.rank: n.image.sent_from for n in plan.nodes if n.image.kind == "send"}
    if sends:
        assert local_id is not None  # the plan sends only an image this machine holds
        with ThreadPoolExecutor(1) as pool:  # the nodes pull the base while the local layer cache fills
            bases = pool.submit(_base_first, nodes, plan, image, console)
            result.update(deliver(nodes, sends, local, local_id, image, console, layer_cache, bases.result, blobs,
                                  plan.relay_mode, plan.master))
    need = [*pulls, *sends]
    for r in need:  # whatever happened, the node must now hold the image by name
        got = image_id(nodes.docker(r), image)
        if got is None or (r in sends and got != local_id):
            raise SSHError(f"{nodes.hosts[r].label}: image {image} still missing after transfer")
    for r in ranks:
        d, label = result[r], nodes.hosts[r].label
        if d.action == "sent":
            line = summary_line(image, label, d.sent, d.layers_sent, d.layers, d.total)
        elif d.action == "relayed":
            line = relayed_line(image, label, d.via, d.layers_sent, d.layers)
        else:
            line = f"image {image} on {label}: " + ("already there, nothing sent" if d.action == "present"
                                                           else "pulled")
        console.print(line, markup=False, highlight=False)
    return {nodes.hosts[r].label: result[r] for r in ranks}
