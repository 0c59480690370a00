"""The facts a plan is built from, all read-only: each node's (preflight's report, the image layers its daemon
holds, whether its data folder holds a verified copy) and this machine's (the job's image, the --data-from)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrate.apply.data import has_verified_copy
from orchestrate.apply.image import all_chain_ids, held_prefix
from orchestrate.config import UpConfig
from orchestrate.plan.jobplan import LocalImage, NodeFacts, Verdict
from orchestrate.probe.preflight import HostReport
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient


def local_image(name: str) -> tuple[DockerClient | None, str | None]:
    """The local daemon's client and image ID (None, None when there is no local daemon)."""
    import docker
    import docker.errors

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception:
        return None, None
    try:
        return client, str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return client, None


def local_layers(client: DockerClient | None, image_id: str | None) -> LocalImage | None:
    """The local image's layers and their sizes. The daemon's history lists one entry per build step, newest
    first, and says nothing of which made a layer: a step of size 0 is taken for one without (ENV, CMD), except a
    WORKDIR (it makes a folder: an empty layer). When the steps taken do not match the layers one for one, the
    sizes are not known."""
    if client is None or image_id is None:
        return None
    diff_ids = tuple(client.images.get(image_id).attrs["RootFS"]["Layers"])
    sizes = tuple(int(h["Size"]) for h in reversed(client.api.history(image_id))
                  if h.get("Size") or "WORKDIR" in (h.get("CreatedBy") or ""))
    return LocalImage(image_id, diff_ids, sizes if len(sizes) == len(diff_ids) else None)


def node_chain_ids(client: DockerClient) -> set[str]:
    """Chain IDs of every layer the node's daemon holds (its images' RootFS layers), over the node's tunnel."""
    layer_lists = []
    for summary in client.api.images(all=True):
        rootfs = client.api.inspect_image(summary["Id"]).get("RootFS") or {}
        layer_lists.append(rootfs.get("Layers") or [])
    return all_chain_ids(layer_lists)


def _layers_held(nodes: Nodes, ranks: Sequence[int], diff_ids: Sequence[str]) -> dict[int, int]:
    found = fan_out("image layers", list(ranks), lambda r: node_chain_ids(nodes.docker(r)),
                    lambda r: nodes.hosts[r].label)
    return {r: held_prefix(diff_ids, chains) for r, chains in zip(ranks, found, strict=True)}


def _data_present(nodes: Nodes, reports: Sequence[HostReport], config: UpConfig) -> list[bool]:
    """Whether each data folder holds a verified copy of the trainer's data (only asked when it may be fetched)."""
    if not config.is_trainer or (config.data_from is not None and config.data_from.is_dir()):
        return [False] * len(reports)
    return fan_out("data check", list(range(len(reports))),
                   lambda r: has_verified_copy(nodes.conn(r), reports[r].dirs["data"], config.data_md5),
                   lambda r: nodes.hosts[r].label)


def node_facts(nodes: Nodes, reports: Sequence[HostReport], config: UpConfig,
               image: LocalImage | None) -> list[NodeFacts]:
    """Every node's facts: its preflight report, and what the plan's image and data actions are decided on."""
    behind = [r for r, rep in enumerate(reports) if image is not None and not config.pull
              and rep.image_id != image.id]
    held = _layers_held(nodes, behind, image.diff_ids) if behind and image is not None else {}
    present = _data_present(nodes, reports, config)
    return [_facts(rep, held.get(r, 0), present[r]) for r, rep in enumerate(reports)]


def _facts(r: HostReport, layers_held: int, data_present: bool) -> NodeFacts:
    ident = r.identity
    return NodeFacts(iface=r.iface, gpus=r.gpus, home=ident.home if ident else None,
                     user=ident.user_spec if ident else None, login=ident.name if ident else None, addr=r.addr,
                     ib=r.ib, gpu_set=r.gpu_set, dirs=dict(r.dirs) or None, image_id=r.image_id, layers_held=layers_held,
                     data_present=data_present, leftovers=tuple(c.name for c in r.containers),
                     verdicts=tuple(Verdict(name, c.ok, c.text, c.warn) for name, c in r.checks.items()))


def local_data(config: UpConfig) -> tuple[int | None, bool]:
    """The --data-from archive's size (None: no archive) and whether --data-from is a folder."""
    if config.data_from is None or config.data_from.is_dir():
        return None, config.data_from is not None
    return config.data_from.stat().st_size, False
