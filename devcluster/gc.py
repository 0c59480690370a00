"""`gc`: remove clusters whose owner is gone and every devcluster object that no cluster owns.

A cluster made by a test session belongs to that process; once it is dead (killed test run), its
cluster is garbage. Clusters made with `up` (persistent) are kept unless all_=True. Objects named
like a cluster (netns, links, iptables rules, processes or mounts under the state root) but with no
live cluster.json are removed too, e.g. after a run killed halfway through `create`. What a killed process left in
the trash (folders of removed clusters, deleted in the background) is deleted again.
"""

from __future__ import annotations

import logging
import re

from . import net
from .layout import LINK_RE, NETNS_RE, RULE_COMMENT, ClusterState, known_states, state_lock, state_root
from .mounts import mounts_under
from .proc import alive, cmdline, pids_matching, start_time
from .teardown import empty_trash, teardown

log = logging.getLogger(__name__)


def owner_alive(state: ClusterState) -> bool:
    """Persistent clusters (no owner) count as alive; an owner pid reused by another process does not."""
    if state.owner_pid is None:
        return True
    return alive(state.owner_pid) and start_time(state.owner_pid) == state.owner_start


def _names_on_machine() -> dict[str, int]:
    """Cluster name -> number of hosts seen, from every kind of object devcluster makes."""
    seen: dict[str, int] = {}

    def note(name: str, index: int = 0) -> None:
        seen[name] = max(seen.get(name, 1), index + 1)

    for ns in net.netns_names():
        if m := NETNS_RE.match(ns):
            note(m.group(1), int(m.group(2)))
    for link in net.link_names():
        if m := LINK_RE.match(link):
            note(m.group(1), int(m.group(2)[1:]) if m.group(2) else 0)
    for _, spec in net.tagged_rules():
        tag = next((p for p in spec if p.startswith(RULE_COMMENT)), "")
        note(tag[len(RULE_COMMENT):])
    root = str(state_root())
    path_re = re.compile(re.escape(root) + r"/([a-z0-9]{1,8})/(?:h(\d+)/)?")
    texts = [cmdline(p) for p in pids_matching(root + "/")] + [str(m) + "/" for m in mounts_under(state_root())]
    if state_root().is_dir():
        texts += [str(d) + "/" for d in state_root().iterdir() if d.is_dir()]
    for text in texts:
        for m in path_re.finditer(text):
            note(m.group(1), int(m.group(2)) if m.group(2) else 0)
    return seen


def gc(all_: bool = False) -> dict[str, list[str]]:
    """Remove garbage clusters; returns {name: traces left} for each one removed (empty list = clean)."""
    removed: dict[str, list[str]] = {}
    with state_lock():  # a cluster being claimed has its cluster.json before gc can look
        states = {s.name: s for s in known_states()}
        keep = {n for n, s in states.items() if not all_ and owner_alive(s)}
        for name, n_hosts in _names_on_machine().items():
            if name in keep:
                continue
            state = states.get(name) or ClusterState(name=name, subnet_index=0, n_hosts=n_hosts)
            state.n_hosts = max(state.n_hosts, n_hosts)
            log.info("removing cluster %s", name)
            removed[name] = teardown(state)
        empty_trash()
    return removed
