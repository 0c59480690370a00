"""The transport of an image's layers to the nodes: each node's `docker load` fed over its Docker connection, from
one filtered `docker save` stream (savetar.py) or from cached compressed blobs (layercache.py), or once to a relay
node that serves the others (relay.py); what each node got (`Delivery`) and its summary line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.progress import Progress

from orchestrate.backends.docker_ssh.layercache import Blob, CachedImage, archive
from orchestrate.backends.docker_ssh.relay import RelayError, fallback_line, relay, relay_address
from orchestrate.backends.docker_ssh.savetar import CHUNK, Feed, Sink, filter_save, load_name
from orchestrate.errors import SSHError
from orchestrate.plan.relay import RelayPlan
from orchestrate.remote.session import Session


class DeltaLoadError(SSHError):
    """`docker load` of a layer delta failed on a node (the caller then sends the full archive)."""


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def summary_line(name: str, label: str, sent: int, layers_sent: int, layers: int, total: int) -> str:
    """The per-node line the tests and the benchmark read: sent N MB (k of m layers) of T MB."""
    return (f"image {name} on {label}: sent {sent / 1e6:.2f} MB ({layers_sent} of {_plural(layers, 'layer')}) "
            f"of {total / 1e6:.0f} MB")


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
    feeds = {r: Feed() for r in ranks}
    sinks = [Sink(p, [feeds[r] for r in ranks if held[r] == p]) for p in sorted({held[r] for r in ranks})]
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


class BlobSource(Protocol):
    """Where cached layer blobs are read: the local layer cache, or the store `submit` wrote (carried.py)."""

    def blob_chunks(self, blob: Blob) -> Iterator[bytes]:
        ...


Source = tuple[BlobSource, CachedImage]


def counted_archives(archive_of: Callable[[int], Iterator[bytes]], bars: Progress, label: str
             ) -> Callable[[int], Iterator[bytes]]:
    """The archives of `archive_of` with a progress bar while they go to the relay node."""
    def counted(keep_from: int) -> Iterator[bytes]:
        task = bars.add_task(f"image -> {label} (relay)", total=None)
        for chunk in archive_of(keep_from):
            bars.advance(task, len(chunk))
            yield chunk

    return counted


def send_relayed(nodes: Session, chosen: RelayPlan, held: dict[int, int],
                 archive_of: Callable[[int], Iterator[bytes]], layers: int, name: str, relay_at: str,
                 console: Console, send: Callable[[Sequence[int], dict[int, int]], dict[int, Delivery]]
                 ) -> dict[int, Delivery]:
    """The archive once to the relay node, which serves it to the others; a node that cannot fetch it (or every
    node, when the relay node fails) is sent its layers from here, one line saying why."""
    assert chosen.relay is not None
    via = nodes.hosts[chosen.relay].label

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    try:
        relayed = relay(nodes, chosen, archive_of(chosen.keep_from), lambda r: relay_address(nodes, r, relay_at), say,
                        name)
    except RelayError as err:
        say(f"image {name}: the relay on {via} failed ({err}); sending each node its layers from here")
        return send(list(held), held)
    done = {chosen.relay: Delivery("sent", relayed.sent, layers - chosen.keep_from, layers, relayed.sent)}
    done.update({r: Delivery("relayed", 0, layers - held[r], layers, relayed.sent, via=relayed.via[r])
                 for r in chosen.fetch})
    for rank, why in sorted(relayed.unfetched.items()):
        say(fallback_line(name, nodes.hosts[rank].label, relayed.via[rank], why))
    if relayed.unfetched:
        done.update(send(sorted(relayed.unfetched), {r: held[r] for r in relayed.unfetched}))
    return done
