"""The facts a plan is built from, all read-only: each node's (preflight's report, the image layers its daemon
holds, whether its data folder holds a verified copy) and this machine's (the --data-from). The daemons' answers
(the layers held, a registry reached, the local image) are the scheduler's reads (probe/daemons.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from orchestrate.config import Data, Delivery
from orchestrate.fanout import fan_out
from orchestrate.probe.daemons import Daemons
from orchestrate.probe.layers import held_prefix
from orchestrate.probe.observations import (
    HostReport,
    LocalBase,
    LocalImage,
    NodeFacts,
    lacks_base,
)

NodesT = TypeVar("NodesT")


def _layers_held(daemons: Daemons[NodesT], nodes: NodesT, ranks: Sequence[int], diff_ids: Sequence[str]) -> dict[int, int]:
    found = daemons.chain_ids(nodes, ranks)
    return {r: held_prefix(diff_ids, chains) for r, chains in zip(ranks, found, strict=True)}


def _data_present(daemons: Daemons[NodesT], nodes: NodesT, reports: Sequence[HostReport], data: Data | None) -> list[bool]:
    """Whether each data folder holds a verified copy of the trainer's data (only asked when it may be fetched;
    `data` None: the program is not the trainer)."""
    if data is None or (data.data_from is not None and data.data_from.is_dir()):
        return [False] * len(reports)
    return fan_out("data check", list(range(len(reports))),
                   lambda r: daemons.data_copy_verified(nodes, r, reports[r].dirs["data"], data.data_md5),
                   lambda r: reports[r].label)


def node_facts(daemons: Daemons[NodesT], nodes: NodesT, reports: Sequence[HostReport], delivery: Delivery, data: Data | None,
               image: LocalImage | None) -> list[NodeFacts]:
    """Every node's facts: its preflight report, and what the plan's image and data actions are decided on (`data`
    None: the program is not the trainer, its data is not looked for); `daemons` reads the image layers there."""
    behind = [r for r, rep in enumerate(reports) if image is not None and not delivery.pull
              and rep.image_id != image.id]
    held = _layers_held(daemons, nodes, behind, image.diff_ids) if behind and image is not None else {}
    base = image.base if image is not None else None
    reach = _base_reach(daemons, nodes, [r for r in behind if lacks_base(base, held[r])], base) if base else {}
    present = _data_present(daemons, nodes, reports, data)
    return [_facts(rep, held.get(r, 0), present[r], reach.get(r, NodeFacts.base_reach)) for r, rep in enumerate(reports)]


def _base_reach(daemons: Daemons[NodesT], nodes: NodesT, ranks: Sequence[int], base: LocalBase) -> dict[int, str]:
    """Whether each node that lacks the base reaches its registry ("" yes, else why not); no question is asked
    when no node may pull it (base.why)."""
    if base.why:
        return {}
    return dict(zip(ranks, daemons.registry_reach(nodes, ranks, base.ref), strict=True))


def _facts(r: HostReport, layers_held: int, data_present: bool, base_reach: str) -> NodeFacts:
    ident = r.identity
    return NodeFacts(iface=r.iface, gpus=r.gpus, home=ident.home if ident else None,
                     user=ident.user_spec if ident else None, login=ident.name if ident else None, addr=r.addr,
                     ib=r.ib, gpu=r.gpu, holdings=r.holdings, dirs=dict(r.dirs) or None, image_id=r.image_id,
                     layers_held=layers_held, base_reach=base_reach, data_present=data_present,
                     leftovers=tuple(c.name for c in r.containers))



def local_data(data: Data) -> tuple[int | None, bool]:
    """The --data-from archive's size (None: no archive) and whether --data-from is a folder."""
    if data.data_from is None or data.data_from.is_dir():
        return None, data.data_from is not None
    return data.data_from.stat().st_size, False


