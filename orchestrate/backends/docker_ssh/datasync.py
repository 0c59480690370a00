"""`up --data-from`: the folder synced into every node's data dir (staging.py, one node), its files relayed inside
the cluster (`--relay`) as the image layers are (relay.py).

The nodes are read first (what each lacks); the files any of them lacks go once from here, as one tar, to the first
node that lacks some (the relay), which unpacks it into its data dir (under its data lock, checked as when sent
from here) and serves it; every other node that lacks files fetches that tar from it over its own SSH session,
checks size and sha256, and unpacks it the same way, under its own lock; then its files are checked again against
the source's digests. A node that cannot fetch (or lacks a file the tar does not hold: it changed since it was
read) is sent its files from here, with one line saying why; a relay node that fails means every node is sent its
files from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console

from orchestrate.backends.docker_ssh.relay import RelayError, RelayTree, Served, serving
from orchestrate.backends.docker_ssh.staging import (
    Entry,
    Put,
    StageResult,
    changed_files,
    check_space,
    local_manifest,
    node_state,
    send_changed,
    stage_node,
    tar_stream,
    unpack_command,
)
from orchestrate.config import Data
from orchestrate.fanout import fan_out
from orchestrate.plan.relay import plan_relay, relay_used
from orchestrate.remote.ssh import Connection

Stage = Callable[[int, "Put | None"], StageResult]  # stages node i, its changed files sent by the Put (None: here)
Progress = Callable[[int], Callable[[int, int], None]]  # node i's progress bar


def stage_all(conns: list[Connection], dirs: Sequence[Mapping[str, str]], data: Data, console: Console,
              relay_mode: str = "off", relay_address: Callable[[int], str] | None = None) -> list[str]:
    """Dirs on every node, then one sync per distinct data folder (shared storage gets it once), in parallel
    with a progress bar per node; one line per node saying what moved. `relay_mode` (--relay): whether the files
    the nodes lack leave here once, to a node that serves them to the others (datarelay.py), reached at
    `relay_address(rank)`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from orchestrate.backends.docker_ssh.data import make_dirs, shared_folders

    source = data.data_from
    assert source is not None
    local = local_manifest(source)
    ranks = list(range(len(conns)))
    fan_out("data dirs", ranks, lambda i: make_dirs(conns[i], dirs[i]), lambda i: conns[i].host.label)
    leaders = shared_folders(conns, [d["data"] for d in dirs])
    syncing = [i for i, lead in enumerate(leaders) if lead == i]
    data_dirs = [d["data"] for d in dirs]
    with Progress(TextColumn("data {task.description}"), BarColumn(), DownloadColumn(), console=console,
                  transient=True) as bars:
        tasks = {i: bars.add_task(conns[i].host.label, total=None) for i in syncing}

        def say(line: str) -> None:
            bars.console.print(line, markup=False, highlight=False, soft_wrap=True)

        def progress(i: int) -> Callable[[int, int], None]:
            return lambda done, total: bars.update(tasks[i], completed=done, total=total or None)

        def stage(i: int, put: Put | None) -> StageResult:
            return stage_node(conns[i], data_dirs[i], source, local, progress(i), say, put)

        if relay_address is None:
            relay_mode = "off"
        results = relay_data(conns, data_dirs, syncing, local, source, relay_mode,
                             relay_address or (lambda i: ""), stage, progress, say)
    return [f"data on {conns[i].host.label}: " + (results[i].describe() if i in results else
            f"same folder as on {conns[leaders[i]].host.label} (shared storage), nothing moved")
            for i in range(len(conns))]


def relay_data(conns: list[Connection], data_dirs: Sequence[str], syncing: Sequence[int], local: dict[str, Entry],
               source: Path, mode: str, address_of: Callable[[int], str], stage: Stage, progress: Progress,
               say: Callable[[str], None]) -> dict[int, StageResult]:
    """Stage every node of `syncing`, the files they lack sent once from here through a relay node when `mode`
    (--relay) says so for the number of nodes that lack some; returns each node's result."""
    def label(i: int) -> str:
        return conns[i].host.label

    if not relay_used(mode, len(syncing)):  # not even if every node lacked files: no need to read them first
        return dict(zip(syncing, fan_out("data staging", list(syncing), lambda i: stage(i, None), label), strict=True))
    lacking = dict(zip(syncing, fan_out("data check", list(syncing),
                                        lambda i: changed_files(local, node_state(conns[i], data_dirs[i])), label),
                       strict=True))
    chosen = plan_relay(mode, {i: 0 for i in syncing if lacking[i]})
    if chosen.relay is None:
        return dict(zip(syncing, fan_out("data staging", list(syncing), lambda i: stage(i, None), label), strict=True))
    relay_rank, via = chosen.relay, label(chosen.relay)
    union = sorted({rel for i in (relay_rank, *chosen.fetch) for rel in lacking[i]})
    union_bytes = sum(local[rel].size for rel in union)
    with ExitStack() as stack:
        served: list[Served] = []

        def put_on_relay(changed: list[str], total: int) -> str | None:
            conn, data_dir = conns[relay_rank], data_dirs[relay_rank]
            check_space(conn, data_dir, union_bytes)
            bar = progress(relay_rank)
            chunks = tar_stream(source, union, lambda n: bar(min(n, union_bytes), union_bytes))
            served.append(stack.enter_context(serving(conn, chunks, unpack_command(data_dir), "data")))
            say(f"data: {len(union)} files ({union_bytes} bytes) sent once from here to {via}, which serves them to "
                f"{len(chosen.fetch)} node(s) (--relay {mode})")
            return None

        try:
            first = stage(relay_rank, put_on_relay)
        except RelayError as err:
            say(f"data: the relay on {via} failed ({err}); sending each node its files from here")
            return dict(zip(syncing, fan_out("data staging", list(syncing), lambda i: stage(i, None), label),
                            strict=True))
        results = {relay_rank: dataclasses.replace(first, bytes_sent=union_bytes if served else first.bytes_sent)}
        tree = RelayTree(chosen, served[0], lambda i: conns[i], address_of, label, say, stack, "data") \
            if served else None

        def put_fetched(i: int) -> Put:
            def put(changed: list[str], total: int) -> str | None:
                why, got_from = _why_not(changed, union, served), via
                if why is None and tree is not None:
                    check_space(conns[i], data_dirs[i], union_bytes)
                    got_from, why = tree.fetch(i, unpack_command(data_dirs[i]))
                if why is None:
                    return got_from
                say(f"data on {label(i)}: could not fetch from the relay on {got_from} ({why}); sending its files "
                    "from here")
                send_changed(conns[i], data_dirs[i], source, changed, total, progress(i))
                return None
            return put

        def stage_fetched(i: int) -> StageResult:
            return stage(i, put_fetched(i))

        # the tree's nodes down the tree; the others (they lacked nothing when read) alongside
        in_tree = set(chosen.fetch) if tree is not None else set()
        rest = [i for i in syncing if i != relay_rank and i not in in_tree]
        with ThreadPoolExecutor(1) as pool:
            aside = pool.submit(fan_out, "data staging", rest, stage_fetched, label)
            if tree is not None:
                results.update(tree.walk(stage_fetched, "data relay"))
            results.update(zip(rest, aside.result(), strict=True))
    return results


def _why_not(changed: list[str], union: list[str], served: list[Served]) -> str | None:
    """Why a node cannot take the relay's tar (None: it can)."""
    if not served:
        return "the relay node held the files already when it was sent them: nothing served"
    missing = sorted(set(changed) - set(union))
    return f"{missing[0]} changed there since it was read: the relay's files do not hold it" if missing else None
