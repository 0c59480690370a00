"""PURE: who gets the image layers (and the --data-from files) from where (`--relay`): sent once from here to a
relay node, fetched by the other nodes inside the cluster, instead of once per node over the user's own link.

The relay is the first node that gets layers sent (node 0 unless it holds the image already). It is sent one
archive holding the layers that the node holding the fewest lacks (`docker load` skips the layers a daemon
holds), so one archive serves every node; the other nodes fetch that archive from it.

Past RELAY_FAN_OUT fetching nodes, a tree: the relay serves the first F, and each node that has fetched and
verified the archive serves up to F more (breadth first: node k of the fetching ones, counted from 0, fetches
from the relay when k < F, else from fetching node k // F - 1). Why F = 4: every copy leaves its server's own link,
so one level costs F copies' time (c = archive / host link) plus a store-and-forward step (L: the parent's fetch
ends and its server starts; it serves the checked file before it loads it, as a parent that loaded first made its
children wait for a `docker load`: 2.04x against 1.30x at 16 hosts, docs/image.md); n nodes fetching need `levels`
with F + F^2 + ... >= n. At 15 fetching nodes (16 hosts), 50 MB on 1 Gbit/s links (c = 0.4 s), L = 1.5 s:
flat 15c = 6.0 s; F=2 4 levels 8c + 3L = 7.7 s; F=3 3 levels 9c + 2L = 6.6 s; F=4 2 levels 8c + L = 4.7 s;
F=8 2 levels 16c + L = 7.9 s. At 255 (256 hosts): flat 102 s; F=4 4 levels 16c + 3L = 10.9 s (docs/benchmarks.md,
"A projection to 256 nodes"). From 5 to 8 fetching nodes the tree's 2 levels carry 8 copies' time, no fewer than
flat: it gains from 9 on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrate.config import RELAY_AUTO_FROM, RELAY_FAN_OUT

# --relay auto starts at config.RELAY_AUTO_FROM (3) nodes that get layers sent: at 2 the relay saves one copy but
# adds a store-and-forward hop and a server start (about 1 s, which a fast link does not win back); from 3 it
# saves two copies or more (measured: docs/image.md, "Relayed inside the cluster").


@dataclass(frozen=True)
class RelayPlan:
    """relay: the rank sent the archive (None: no relay, every node is sent its own layers from here);
    fetch: the ranks that get the archive inside the cluster, in the order they are served; parents: per rank of
    `fetch` (same order), the rank it fetches from (the relay, or a fetching node that serves once it holds the
    archive); keep_from: the leading layers the archive leaves out."""

    relay: int | None
    fetch: tuple[int, ...] = ()
    keep_from: int = 0
    parents: tuple[int, ...] = ()

    def parent(self, rank: int) -> int | None:
        """The rank `rank` fetches from (None: it is sent the bytes from here)."""
        return dict(zip(self.fetch, self.parents, strict=True)).get(rank)

    def children(self, rank: int) -> tuple[int, ...]:
        """The ranks that fetch from `rank`, in order."""
        return tuple(r for r, p in zip(self.fetch, self.parents, strict=True) if p == rank)

    def ancestors(self, rank: int) -> tuple[int, ...]:
        """The ranks above `rank`, nearest first, the relay last (empty for the relay and the nodes sent from here)."""
        chain: list[int] = []
        up = self.parent(rank)
        while up is not None:
            chain.append(up)
            up = self.parent(up)
        return tuple(chain)

    def source(self, rank: int) -> str:
        """Where `rank` gets its layers: 'here' (this machine) or 'node R' (the node that serves it)."""
        up = self.parent(rank)
        return "here" if up is None else f"node {up}"


def relay_used(mode: str, receivers: int) -> bool:
    """Whether the layers go through a relay, for `receivers` nodes that lack some (`--relay`)."""
    if receivers < 2 or mode == "off":
        return False
    return mode == "on" or receivers >= RELAY_AUTO_FROM


def tree_parents(relay: int, fetch: tuple[int, ...], fan_out: int = RELAY_FAN_OUT) -> tuple[int, ...]:
    """Per rank of `fetch`, whom it fetches from: the relay serves the first `fan_out`, each of those the next
    `fan_out` in turn (breadth first), so no node serves more than `fan_out` and the depth grows as log(n)."""
    servers = (relay, *fetch)
    return tuple(servers[k // fan_out] for k in range(len(fetch)))


def plan_relay(mode: str, held: Mapping[int, int], fan_out: int = RELAY_FAN_OUT) -> RelayPlan:
    """`held`: per node that gets layers sent, how many leading layers it holds (or gets by a pull of its base)."""
    receivers = sorted(held)
    if not relay_used(mode, len(receivers)):
        return RelayPlan(None)
    fetch = tuple(receivers[1:])
    return RelayPlan(receivers[0], fetch, min(held.values()), tree_parents(receivers[0], fetch, fan_out))


def plan_copy_relay(mode: str, source: int, receivers: Sequence[int], fan_out: int = RELAY_FAN_OUT) -> RelayPlan:
    """Files one node holds already (the resume checkpoint): that node is the relay, serving them to `receivers`
    down the same tree, when `mode` relays a tree of that many nodes (the same rule as for the layers, which counts
    the relay node among them: auto from RELAY_AUTO_FROM nodes in all, on from 2). Nothing leaves from here."""
    fetch = tuple(sorted(receivers))
    if not fetch or not relay_used(mode, 1 + len(fetch)):
        return RelayPlan(None)
    return RelayPlan(source, fetch, 0, tree_parents(source, fetch, fan_out))
