"""Per node, idempotent: create the dirs, then fetch + verify + extract CIFAR-10 into the data dir.

The work runs on the node in a short `--rm --network=host` container of the job's image, with a stdlib-only
script passed as an argument (no shell), so the node needs nothing but Docker. A node whose data dir holds the
verified marker for the expected md5 is left alone: nothing is downloaded or sent.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from orchestrate.backends.docker_ssh.datacopy import has_verified_copy
from orchestrate.backends.docker_ssh.datalock import data_lock
from orchestrate.backends.docker_ssh.relay import (
    RelayError,
    RelayTree,
    Served,
    relay_address,
    serving,
)
from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.config import Data
from orchestrate.errors import SSHError
from orchestrate.fanout import fan_out
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.plan.relay import RelayPlan, plan_relay
from orchestrate.remote import scripts
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import Connection
from trainer.contract import ARCHIVE_NAME

ARCHIVE = ARCHIVE_NAME
SCRIPT = scripts.text("fetch.py")


@dataclass(frozen=True)
class PrefetchResult:
    label: str
    action: str  # "present" | "downloaded" | "sent" | "relayed" | "shared"
    bytes_moved: int
    shared_with: str = ""  # for "shared": the node whose fetch filled the same folder; "relayed": the relay node


# puts the --data-from archive at a node's path; returns the bytes sent from here and the relay node it came from ("")
SendArchive = Callable[[Connection, str], tuple[int, str]]
LAND_ARCHIVE = ["sh", "-c", 'cat > "$1.relay" && mv -f -- "$1.relay" "$1"', "land"]  # + the path: a whole file only


def make_dirs(conn: Connection, dirs: Mapping[str, str]) -> Mapping[str, str]:
    """Create the node's planned dirs as the SSH login (so they are the user's)."""
    conn.run(["mkdir", "-p", "--", *dirs.values()], timeout=30, check=True)
    return dirs


def prefetch_node(conn: Connection, data_dir: str, docker_client: Callable[[], object], data: Data,
                  fetch: ContainerSpec, progress: Callable[[int, int], None],
                  say: Callable[[str], None], send: SendArchive | None = None) -> PrefetchResult:
    """A verified CIFAR-10 copy in the node's (existing) data dir, which the plan found without one, made under
    the folder's lock (another `up` filling it is waited for, then its copy is used) by the plan's fetch container
    `fetch`. Raises SSHError saying what went wrong."""
    with data_lock(conn, data_dir, say) as held:
        if has_verified_copy(conn, data_dir, data.data_md5):  # made by the up that held the lock before us
            return PrefetchResult(conn.host.label, "present", 0)
        if not held.writable:
            raise held.refuse(data_dir, "holds no verified copy")
        return _fill(conn, docker_client, data, fetch, data_dir, progress, send)


def _fill(conn: Connection, docker_client: Callable[[], object], data: Data, fetch: ContainerSpec,
          data_dir: str, progress: Callable[[int, int], None], send: SendArchive | None) -> PrefetchResult:
    """`send`: how the --data-from archive gets there (default: from here; through a relay with --relay)."""
    sent, via = 0, ""
    if data.data_from is not None:  # the fetch then checks and unpacks it (its DATA_URL is "-")
        remote = posixpath.join(data_dir, ARCHIVE)
        if send is None:
            sent = send_archive(conn, data.data_from, data.data_md5, remote, progress)
        else:
            sent, via = send(conn, remote)
    fetched = _run_fetch(docker_client(), fetch, data_dir, progress)  # a client only when needed
    if via:
        return PrefetchResult(conn.host.label, "relayed", 0, shared_with=via)
    return PrefetchResult(conn.host.label, "sent" if sent else "downloaded", sent or fetched)


def send_archive(conn: Connection, local: Path, md5: str, remote: str, progress: Callable[[int, int], None]) -> int:
    """Upload the archive unless the node holds one with the expected md5 (a corrupt copy of the same size is
    replaced, not trusted); the upload goes through a temporary name (Connection.write_file)."""
    have = conn.run(["md5sum", "--", remote], timeout=300)
    if have.rc == 0 and have.out.split()[:1] == [md5]:
        return 0
    conn.write_file(remote, _blocks(local, progress))
    return local.stat().st_size


def _blocks(local: Path, progress: Callable[[int, int], None]) -> Iterator[bytes]:
    size, done = local.stat().st_size, 0
    with open(local, "rb") as fh:
        while block := fh.read(1 << 20):
            done += len(block)
            progress(done, size)
            yield block


def _run_fetch(client: object, fetch: ContainerSpec, data_dir: str, progress: Callable[[int, int], None]) -> int:
    """The plan's fetch container (plan/shortlived.py), over this host's Docker client, to its end."""
    container = client.containers.run(**sdk_kwargs(fetch))  # type: ignore[attr-defined]
    lines: list[str] = []
    try:
        for raw in container.logs(stream=True, follow=True):
            for line in raw.decode(errors="replace").splitlines():
                lines.append(line)
                if line.startswith("PROGRESS "):
                    _, done, total = line.split()
                    progress(int(done), int(total))
        code = container.wait(timeout=3600).get("StatusCode", -1)
    finally:
        try:
            container.remove(force=True)
        except Exception:  # best effort: the container is ours (labelled) and already finished
            pass
    if code != 0:
        error = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "no output")
        raise SSHError(f"data prefetch into {data_dir} failed: {error.removeprefix('error: ')}")
    done = next((ln for ln in lines if ln.startswith("DONE ")), "DONE 0")
    return int(done.split()[1])


def shared_folders(conns: Sequence[Connection], folders: Sequence[str]) -> list[int]:
    """For each node, the first node that sees the same folder (itself when it shares with none earlier).

    Each node writes a file with a random token and its index into its folder; a node that lists the files of
    others there shares the folder with them (an NFS home, a /data mount), whatever the paths are called."""
    prefix = f".ddp-cifar-share-{secrets.token_hex(8)}-"
    ranks = list(range(len(conns)))
    fan_out("shared-storage check", ranks, lambda i: _token(conns[i], posixpath.join(folders[i], f"{prefix}{i}")),
            lambda i: conns[i].host.label)
    try:
        seen = fan_out("shared-storage check", ranks, lambda i: conns[i].list_dir(folders[i]),
                       lambda i: conns[i].host.label)
    finally:
        fan_out("shared-storage check", ranks,
                lambda i: conns[i].run(["rm", "-f", "--", posixpath.join(folders[i], f"{prefix}{i}")], timeout=30),
                lambda i: conns[i].host.label)
    return [min([i] + [int(n[len(prefix):]) for n in seen[i] if n.startswith(prefix) and n[len(prefix):].isdigit()])
            for i in ranks]


def _token(conn: Connection, path: str) -> None:
    """An empty file; none in a folder the login may not write (another person's, only read: datalock.py)."""
    if conn.run(["test", "-w", posixpath.dirname(path)], timeout=30).rc == 0:
        conn.write_file(path, iter((b"",)), timeout=30)


def prefetch_all(nodes: Session, dirs: Sequence[Mapping[str, str]], fetches: Sequence[ContainerSpec | None], data: Data,
                 console: object, relay_mode: str = "off", relay_at: str = "") -> list[PrefetchResult]:
    """Dirs on every node, then one fetch per distinct data folder (nodes that share a folder, as on NFS, get
    it once) where the plan found no verified copy (it planned a fetch container: `fetches`), in parallel with
    one progress bar per node; every failure is reported. A --data-from archive goes to each such node from here,
    or (`relay_mode`, --relay) once to the first, which serves it to the others (reached at `relay_at`, the
    rendezvous address: see relay_address)."""
    conns = nodes.connected()
    present = [f is None for f in fetches]
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    ranks = list(range(len(conns)))
    fan_out("data dirs", ranks, lambda i: make_dirs(conns[i], dirs[i]), lambda i: conns[i].host.label)
    leaders = shared_folders(conns, [d["data"] for d in dirs])
    fetching = [i for i, lead in enumerate(leaders) if lead == i and not present[i]]
    with Progress(TextColumn("data {task.description}"), BarColumn(), DownloadColumn(),
                  console=console, transient=True) as bars:  # type: ignore[arg-type]
        tasks = {i: bars.add_task(conns[i].host.label, total=None) for i in fetching}

        def say(line: str) -> None:
            bars.console.print(line, markup=False, highlight=False, soft_wrap=True)

        def one(i: int, send: SendArchive | None = None) -> PrefetchResult:
            def update(done: int, total: int) -> None:
                bars.update(tasks[i], completed=done, total=total or None)
            fetch = fetches[i]
            assert fetch is not None  # not present: planned
            return prefetch_node(conns[i], dirs[i]["data"], lambda: nodes.docker(i, timeout=3600), data, fetch, update,
                                 say, send)

        chosen = plan_relay(relay_mode, {i: 0 for i in fetching}) if data.data_from is not None and relay_at \
            else RelayPlan(None)
        if chosen.relay is None:
            fetched = dict(zip(fetching, fan_out("data prefetch", fetching, one, lambda i: conns[i].host.label),
                               strict=True))
        else:
            fetched = _relayed(nodes, chosen, data, one, say, lambda r: relay_address(nodes, r, relay_at))
    return [fetched[i] if i in fetched else PrefetchResult(conns[i].host.label, "present", 0) if present[i] else
            PrefetchResult(conns[i].host.label, "shared", 0, shared_with=conns[leaders[i]].host.label)
            for i in range(len(conns))]


def _relayed(nodes: Session, chosen: RelayPlan, data: Data, one: Callable[[int, SendArchive | None], PrefetchResult],
             say: Callable[[str], None], address_of: Callable[[int], str]) -> dict[int, PrefetchResult]:
    """The archive sent once, to the relay node, which serves it while the others fetch it down the plan's tree
    (relay.py); a node that cannot fetch it is sent it from here, one line saying why; a relay node that fails,
    every node."""
    assert chosen.relay is not None and data.data_from is not None
    source, md5 = data.data_from, data.data_md5
    via = nodes.hosts[chosen.relay].label
    served: list[Served] = []

    def label(i: int) -> str:
        return nodes.hosts[i].label

    with ExitStack() as stack:
        def to_relay(conn: Connection, remote: str) -> tuple[int, str]:
            chunks = _blocks(source, lambda done, total: None)
            served.append(stack.enter_context(serving(conn, chunks, [*LAND_ARCHIVE, remote], "data")))
            say(f"data: {source.name} ({served[0].size} bytes) sent once from here to {via}, which serves it to "
                f"{len(chosen.fetch)} node(s)")
            return served[0].size, ""

        try:
            results = {chosen.relay: one(chosen.relay, to_relay)}
        except RelayError as err:
            say(f"data: the relay on {via} failed ({err}); sending each node the archive from here")
            everyone = [chosen.relay, *chosen.fetch]
            return dict(zip(everyone, fan_out("data prefetch", everyone, lambda i: one(i, None), label), strict=True))

        tree = RelayTree(chosen, served[0], nodes.conn, address_of, label, say, stack, "data")

        def fetched_from_relay(rank: int) -> SendArchive:
            def fetched(conn: Connection, remote: str) -> tuple[int, str]:
                got_from, why = tree.fetch(rank, [*LAND_ARCHIVE, remote])
                if why is None:
                    return 0, got_from
                say(f"data on {conn.host.label}: could not fetch from the relay on {got_from} ({why}); sending the "
                    "archive from here")
                return send_archive(conn, source, md5, remote, lambda done, total: None), ""
            return fetched

        results.update(tree.walk(lambda i: one(i, fetched_from_relay(i)), "data relay"))
    return results
