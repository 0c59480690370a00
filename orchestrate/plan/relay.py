"""PURE: who gets the image layers from where (`--relay`): sent once from here to a relay node, fetched by the
other nodes from it inside the cluster, instead of once per node over the user's own link.

The relay is the first node that gets layers sent (node 0 unless it holds the image already). It is sent one
archive holding the layers that the node holding the fewest lacks (`docker load` skips the layers a daemon
holds), so one archive serves every node; the other nodes fetch that archive from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrate.config import RELAY_AUTO_FROM

# --relay auto starts at config.RELAY_AUTO_FROM (3) nodes that get layers sent: at 2 the relay saves one copy but
# adds a store-and-forward hop and a server start (about 1 s, which a fast link does not win back); from 3 it
# saves two copies or more (measured: docs/image.md, "Relayed inside the cluster").


@dataclass(frozen=True)
class RelayPlan:
    """relay: the rank sent the archive (None: no relay, every node is sent its own layers from here);
    fetch: the ranks that get the relay's archive from it; keep_from: the leading layers the archive leaves out."""

    relay: int | None
    fetch: tuple[int, ...] = ()
    keep_from: int = 0

    def source(self, rank: int) -> str:
        """Where `rank` gets its layers: 'here' (this machine) or 'node R' (the relay)."""
        return f"node {self.relay}" if rank in self.fetch else "here"


def relay_used(mode: str, receivers: int) -> bool:
    """Whether the layers go through a relay, for `receivers` nodes that lack some (`--relay`)."""
    if receivers < 2 or mode == "off":
        return False
    return mode == "on" or receivers >= RELAY_AUTO_FROM


def plan_relay(mode: str, held: Mapping[int, int]) -> RelayPlan:
    """`held`: per node that gets layers sent, how many leading layers it holds (or gets by a pull of its base)."""
    receivers = sorted(held)
    if not relay_used(mode, len(receivers)):
        return RelayPlan(None)
    return RelayPlan(receivers[0], tuple(receivers[1:]), min(held.values()))

