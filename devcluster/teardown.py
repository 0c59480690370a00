"""Removing a cluster without a trace, and listing what of it is left (for tests and `gc`)."""

from __future__ import annotations

import logging
import secrets
import subprocess
from collections.abc import Callable
from pathlib import Path

from . import dockerd, net, slurmd, sshd
from .layout import ClusterState, HostLayout, state_root
from .mounts import mounts_under, unmount_under
from .proc import pids_in_netns, pids_matching, stop_pids

log = logging.getLogger(__name__)

# Under the state root: folders of removed clusters, deleted by a process of their own. Deleting a host's dockerd
# data root takes ~40 s per GB of image on a disk mounted with `discard` (measured here: `rm -rf` of one 773 MB
# image layer, 14.6k files, 36.5 s, 1 s of it CPU), and no one needs to wait for it.
TRASH = ".trash"


def teardown_host(host: HostLayout) -> None:
    """Containers, dockerd, containerd, shims, sshd and its sessions, every process left in the netns,
    the mounts under the host's folder, the netns (its eth0 and so the veth pair go with it)."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("remove containers", lambda: dockerd.remove_containers(host)),
        ("stop docker", lambda: dockerd.stop_docker(host)),
        ("stop sshd", lambda: sshd.stop_sshd(host)),
        ("stop leftover processes", lambda: stop_leftovers(host)),
        ("unmount", lambda: unmount_under(host.dir)),
        ("delete netns", lambda: net.delete_netns(host.netns)),
        ("delete veth", lambda: net.delete_link(host.veth)),
    ]
    for what, step in steps:  # each step runs even if an earlier one failed
        try:
            step()
        except Exception as e:
            log.warning("%s: %s failed: %s", host.alias, what, e)


def stop_leftovers(host: HostLayout) -> None:
    """Every process still in the host's netns or naming its folder (ssh sessions, container processes)."""
    pids = sorted(set(pids_in_netns(host.netns) + pids_matching(str(host.dir) + "/")))
    if pids:
        stop_pids(pids, grace=3)


def teardown(state: ClusterState) -> list[str]:
    """Remove everything of the cluster; returns the traces that could not be removed (empty = clean)."""
    slurmd.stop_slurm(state)  # first: a slurmd whose host is gone would be drained, not stopped
    for host in state.hosts():
        teardown_host(host)
    net.remove_rules(state.name)
    net.delete_link(state.bridge)
    # never delete a folder through a mount that is still there (it could be a bind of other data)
    if state.dir.is_dir() and not unmount_under(state.dir):
        discard(state.dir)
    return traces(state.name)


def discard(folder: Path) -> None:
    """Move folder into the trash (a rename on the same disk: at once) and delete it there in the background."""
    trash = state_root() / TRASH
    trash.mkdir(mode=0o700, exist_ok=True)
    # a fresh name, never a folder made first: another session's gc may be emptying the trash right now
    moved = trash / f"{folder.name}-{secrets.token_hex(4)}"
    folder.rename(moved)
    _delete_in_background(moved)


def empty_trash() -> None:
    """Delete what the trash holds in the background: folders whose deletion a killed process left unfinished."""
    trash = state_root() / TRASH
    if trash.is_dir():
        for moved in trash.iterdir():
            _delete_in_background(moved)


def _delete_in_background(path: Path) -> None:
    # `setsid -f`: rm in a session of its own, not our child (nothing to reap): it outlives this process (a test
    # session ends while the disk still works) and no Ctrl-C of ours reaches it. --one-file-system: never through
    # a mount, whatever was mounted there since. No pipes: rm would hold them open, and we would wait for it.
    subprocess.run(["setsid", "-f", "rm", "-rf", "--one-file-system", str(path)], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=10)


def traces(name: str) -> list[str]:
    """Everything on the machine that still belongs to cluster name: netns, links, processes whose
    command line names its folder, mounts under it, iptables rules, its folder."""
    d = state_root() / name
    found = [f"netns {n}" for n in net.netns_names() if n.startswith(f"dc-{name}-h")]
    found += [f"link {n}" for n in net.link_names() if n == f"dcb-{name}" or n.startswith(f"dcv-{name}-")]
    found += [f"process {p}" for p in pids_matching(str(d) + "/")]
    found += [f"mount {m}" for m in mounts_under(d)]
    found += [f"iptables {chain} {' '.join(spec)}" for chain, spec in net.tagged_rules(name)]
    if d.exists():
        found.append(f"dir {d}")
    return found

