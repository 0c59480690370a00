"""GPU sets on shared hosts: which device indices a job gets on a node, and who yields when two claim one. PURE.

Every job container carries the label `ddp-cifar.gpus` with the device indices it holds (docs/shared-hosts.md).
The labels of every container on a daemon that still holds its GPUs (running, restarting, or created and not yet
started) are the truth: `--gpus N` takes N indices no other job holds, `--gpus all` and indices given by hand
are refused while another job holds any of theirs, and the refusal names the holders (owner/job).

Two `up`s that read the labels at the same moment could pick the same GPUs. The claim is therefore checked
after the containers exist: each `up` creates its containers (not started), reads the other containers' labels
on the same daemon again, and where two overlap (a GPU, or node 0's master port), the one created later (by
Docker's creation time, ties by container ID) removes its containers and plans again after a short random
wait. Why this and not a lock file on the host: it needs nothing shared but the daemon both already talk to
(no folder every login can write, no lock left behind by a killed `up`), and the order is the daemon's own
(creation time, ID), which both sides read alike, so exactly one of two overlapping claims survives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrate.config import Resources
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.plan import gpus
from orchestrate.probe.observations import GpuSeen, Held, Holdings

_FRACTION = re.compile(r"\.([0-9]+)")


def holders_of(indices: Iterable[int], others: Sequence[Held]) -> str:
    """PURE: the holders of these GPUs, for one line: `ddp2/cifar (GPU 0,1), bob/r18 (GPU 2)`."""
    wanted = set(indices)
    parts: dict[str, set[int]] = {}
    for h in others:
        hit = sorted(wanted & set(h.gpus))
        if hit:
            parts.setdefault(h.who, set()).update(hit)
    return ", ".join(f"{who} (GPU {','.join(map(str, sorted(ids)))})" for who, ids in sorted(parts.items()))


@dataclass(frozen=True)
class Grant:
    """The GPUs a job gets on one node, or why it gets none (one line)."""

    gpus: tuple[int, ...] = ()
    problem: str | None = None


def allocate(count: int, ids: Sequence[int], present: Sequence[int], others: Sequence[Held],
             keep: Sequence[int] = ()) -> Grant:
    """PURE: the device indices a request gets on a node whose GPUs are `present`, given what the other jobs'
    containers hold. `keep`: the indices this job held before (a restart keeps them while they are free)."""
    taken = {i for h in others for i in h.gpus}
    if ids:
        clash = [i for i in ids if i in taken]
        if clash:
            return Grant(problem=f"--gpus {','.join(map(str, ids))}: held by {holders_of(clash, others)}; choose "
                                 "free GPUs or ask for a count (--gpus N)")
        return Grant(tuple(ids))
    if count == GPUS_ALL:
        if taken & set(present):
            return Grant(problem=f"--gpus all: held by {holders_of(present, others)}; ask for a count of free "
                                 "GPUs (--gpus N), or wait until they are free")
        return Grant(tuple(sorted(present)))
    free = [i for i in keep if i in present and i not in taken]
    free += [i for i in sorted(present) if i not in taken and i not in free]
    if len(free) < count:
        return Grant(problem=f"--gpus {count}: {len(free)} of {len(present)} GPU(s) free here, held by "
                             f"{holders_of(present, others)}; ask for fewer or wait until they are free")
    return Grant(tuple(free[:count]))


@dataclass(frozen=True)
class GpuSet:
    """The GPUs one node gets, and why: what the container's device request, its label and its process count are
    built from, what preflight's `gpus` cell says and what `--dry-run=hosts` prints."""

    ids: tuple[int, ...] = ()  # the device indices (empty: CPU, Docker's first N, every GPU, or refused)
    why: str = ""  # one line: why these (or, refused, why the node cannot run the job)
    refused: bool = False
    held: bool = False  # chosen from the node's own nvidia-smi and labels: the containers carry it as their claim
    busy: str | None = None  # a warning: the GPUs chosen already run compute processes (another job's, most likely)


def decide_gpus(resources: Resources, host: Host, seen: GpuSeen | None, holdings: Holdings) -> GpuSet:
    """PURE: which GPUs node `host` gets, and why; the one place that decides it. From the request (`--gpus`, or the
    host's own `gpu_ids=`, an allocator's grant, which stands for it there), what nvidia-smi listed there (`seen`;
    None: not probed, the offline dry run) and what the other jobs' containers there hold (their labels; a restart
    keeps the set this job held while it is free). After a lost claim it is asked again with the labels then."""
    if not resources.gpus:
        return GpuSet(why="CPU mode")
    asked = gpus.granted_here(resources, host)
    if seen is None:
        return _not_probed(asked, host)
    if seen.smi == "missing":
        return _refused("nvidia-smi not found (no NVIDIA driver); install it, or use --gpus 0 for CPU")
    if seen.smi != "ok":
        return _refused(f"nvidia-smi failed: {' '.join(seen.smi.split())[:120]}")
    need = max(asked.gpus, host.slots or 0, 1)
    if seen.count < need:
        return _refused(f"{seen.count} GPU(s) visible, {need} needed; lower --gpus or slots=")
    absent = gpus.absent_indices(asked.gpu_ids, seen.gpu_list)
    if absent:
        return _refused(absent)
    present = gpus.gpu_indices(seen.gpu_list)
    grant = allocate(asked.gpus, asked.gpu_ids, present, holdings.others, holdings.own_gpus)
    if grant.problem:
        return _refused(grant.problem)
    rest = holders_of(present, holdings.others)
    busy = gpus.busy_warning(asked.gpus, grant.gpus, seen.gpu_list, seen.compute_apps)
    return GpuSet(grant.gpus, f"GPU {gpus.gpus_text(grant.gpus)} of {seen.count}" + (f"; others: {rest}" if rest else ""),
                  held=True, busy=busy)


def _refused(why: str) -> GpuSet:
    return GpuSet(why=why, refused=True)


def _not_probed(asked: Resources, host: Host) -> GpuSet:
    """The offline dry run's answer: the indices asked for, or what Docker will give, nothing checked."""
    if asked.gpu_ids:
        source = f"gpu_ids= of {host.source}" if host.gpu_ids else "--gpus"
        return GpuSet(asked.gpu_ids, f"GPU {gpus.gpus_text(asked.gpu_ids)} as {source} lists them (not probed)")
    if asked.gpus == GPUS_ALL:
        return GpuSet(why="every GPU of the node (--gpus all; not probed)")
    return GpuSet(why=f"the first {asked.gpus} GPU(s) the node's Docker gives (not probed)")


def created_key(h: Held) -> tuple[str, str]:
    """PURE: the order of creation as the daemon recorded it. Docker trims trailing zeros of the fraction
    (RFC 3339 nano), so the fraction is padded to 9 digits before the strings are compared; ties by ID."""
    return _FRACTION.sub(lambda m: "." + m.group(1).ljust(9, "0"), h.created, count=1), h.id


def overlaps(a: Held, b: Held) -> bool:
    """PURE: two claims that cannot both stand on one daemon: a GPU in common, or the same master port."""
    return bool(set(a.gpus) & set(b.gpus)) or (a.port is not None and a.port == b.port)


def yields_to(mine: Held, others: Sequence[Held]) -> list[Held]:
    """PURE: the containers created before `mine` whose claim overlaps it (empty: mine stands)."""
    return [o for o in others if o.id != mine.id and overlaps(mine, o) and created_key(o) < created_key(mine)]
