"""Give every node the job's image, sending only the layers its daemon lacks.

The layers come from the local layer cache (layercache.py: the cached compressed blobs, nothing read or
compressed but the new layers) when `--layer-cache` allows it, else from one `docker save` stream filtered
per node (savetar.py); sendlayers.py carries them to the nodes (directly, or through a relay node), and
basepull.py has a node pull the image's base first where the plan says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from orchestrate.backends.docker_ssh.basepull import base_first
from orchestrate.backends.docker_ssh.layercache import archive, fill_cache, open_cache
from orchestrate.backends.docker_ssh.relay import relayed_line
from orchestrate.backends.docker_ssh.savetar import load_name, saved_archive
from orchestrate.backends.docker_ssh.sendlayers import (
    Delivery,
    Source,
    counted_archives,
    send_cached,
    send_layers,
    send_relayed,
    summary_line,
)
from orchestrate.errors import SSHError
from orchestrate.fanout import fan_out
from orchestrate.plan.jobplan import JobPlan
from orchestrate.plan.relay import plan_relay
from orchestrate.remote.docker import image_id
from orchestrate.remote.session import Session


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
            done = send_relayed(nodes, chosen, dict(held), counted_archives(archive_of, bars, nodes.hosts[chosen.relay].label),
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
            bases = pool.submit(base_first, nodes, plan, image, console)
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
