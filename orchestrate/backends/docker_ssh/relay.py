"""The image layers relayed inside the cluster (`--relay`, plan/relay.py decides who gets what from where).

The same mechanism carries the `--data-from` files (staging.py): only what lands the archive differs; and the resume
checkpoint (ckptrelay.py), whose archive is packed on the node that holds it (`serving_packed`): nothing is sent
from here.

One archive (the layers the node holding the fewest lacks) goes from here to the relay node over SSH, into a file
in its ~/.cache/ddp-cifar/relay, its sha256 computed here as it goes; the relay node loads it. Then a stdlib
server (remote/scripts/relay.py, the host's python3) serves that file on a free port of the relay node, to clients
that present a random token; each other node fetches it (the same script, started over SSH), checks its size and
sha256 before `docker load`, and removes it. The server runs in the foreground of one SSH channel: when delivery
ends (or this process dies), the channel closes, the server removes the file and exits. No node logs in to
another; nothing is left running. A node whose fetch fails is reported, and the caller sends it its layers from
here.

Past the plan's fan-out, a tree (plan/relay.py): a fetching node that others fetch from keeps the archive once
fetched and checked, and serves it the same way (its own server on its own SSH channel from here, the same token)
to its children, which start fetching then, while it lands the archive itself (`RelayTree`). A node whose parent could not fetch or serve
fetches from the nearest ancestor that serves; a fetch that fails on reaching its server or on its bytes is tried
once more from the next ancestor up; each says so in one line. What still fails is sent from here by the caller.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TypeVar

import paramiko

from orchestrate.errors import SSHError
from orchestrate.fanout import fan_out
from orchestrate.plan.relay import RelayPlan
from orchestrate.remote import scripts
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import Connection, quote_command

RELAY_SCRIPT = scripts.text("relay.py")
RELAY_DIR = ".cache/ddp-cifar/relay"
SERVER_START_S = 30.0
SERVER_END_S = 15.0
LOAD_S = 3600.0
LOAD_IMAGE = ("docker", "load", "-q")  # how a node lands the image archive (on its stdin)
RETRY_UP = (3, 4)  # fetch exits tried once more from the next ancestor up: the server unreachable, the bytes wrong
FETCH_EXITS = {3: "cannot reach the relay", 4: "the bytes fetched do not match", 5: "the node could not load them",
               6: "the node could not pack them", 127: "no python3 on the node"}


class RelayError(SSHError):
    """The relay node could not be sent, load or serve the archive (the caller sends every node its layers)."""


@dataclass
class Relayed:
    """What the relay did: bytes sent from here (to the relay node only), per fetching node the node it fetched from
    (or tried last), and per node that fetched nothing, why."""

    sent: int
    via: dict[int, str]
    unfetched: dict[int, str]


def _docker_env(conn: Connection) -> dict[str, str]:
    return {"DOCKER_HOST": conn.host.docker_host} if conn.host.docker_host else {}


def _why(res_err: str, rc: int) -> str:
    last = (res_err.strip().splitlines() or [""])[-1]
    return f"{FETCH_EXITS.get(rc, f'exit {rc}')}: {last}" if last else FETCH_EXITS.get(rc, f"exit {rc}")


def _put(conn: Connection, chunks: Iterator[bytes], path: str) -> tuple[int, str]:
    """The archive into `path` on the relay node; returns its size and sha256."""
    digest, size = hashlib.sha256(), [0]

    def counted() -> Iterator[bytes]:
        for chunk in chunks:
            digest.update(chunk)
            size[0] += len(chunk)
            yield chunk

    conn.write_file(path, counted())
    return size[0], digest.hexdigest()


def _serve(conn: Connection, path: str, token: str) -> tuple[paramiko.Channel, int]:
    """The server started on the relay node; returns its channel (closing it ends the server) and its port."""
    chan = conn.open_channel()
    chan.settimeout(SERVER_START_S)
    chan.exec_command(quote_command(["python3", "-c", RELAY_SCRIPT, "serve", path]))
    chan.sendall(token.encode() + b"\n")
    line = b""
    try:
        while not line.endswith(b"\n"):
            piece = chan.recv(64)
            if not piece:
                break
            line += piece
    except TimeoutError:
        pass
    word, _, port = line.decode(errors="replace").strip().partition(" ")
    if word != "PORT" or not port.isdigit():
        err = chan.recv_stderr(4096).decode(errors="replace").strip().splitlines()[-1:] if chan.recv_stderr_ready() \
            else []
        chan.close()
        raise RelayError(f"the relay server did not start ({err[0] if err else 'no python3?'})")
    return chan, int(port)


def _stop(chan: paramiko.Channel) -> None:
    """End the server: its stdin closes, it removes the archive and exits (waited for, bounded)."""
    try:
        chan.shutdown_write()
        deadline = time.monotonic() + SERVER_END_S
        while not chan.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        chan.close()


@dataclass(frozen=True)
class Served:
    """An archive the relay node holds and serves: where (port), to whom (token), what (size, sha256)."""

    port: int
    token: str
    size: int
    sha256: str


@contextmanager
def serving(conn: Connection, chunks: Iterator[bytes], land: Sequence[str], what: str) -> Iterator[Served]:
    """`chunks` (the archive) into a file on the relay node, landed there (`land`: the command that takes it on stdin,
    e.g. `docker load -q`), then served to token holders until the block ends: then the server stops and the file is
    removed. RelayError: the relay node could not be sent, land or serve it (`what` names the archive)."""
    def put(path: str) -> tuple[int, str]:
        conn.run(["mkdir", "-p", "--", posixpath.dirname(path)], timeout=30, check=True)
        size, sha256 = _put(conn, chunks, path)
        landed = conn.run(["sh", "-c", 'f=$1; shift; "$@" < "$f"', "land", path, *land], env=_docker_env(conn),
                          timeout=LOAD_S)
        if landed.rc != 0:
            raise RelayError(f"{land[0]} of the archive failed: {_why(landed.err, landed.rc)}")
        return size, sha256

    with _serving_made(conn, put, what) as served:
        yield served


@contextmanager
def serving_packed(conn: Connection, folder: str, names: Sequence[str], what: str) -> Iterator[Served]:
    """The files `names` (relative to `folder`) that the node holds already packed there into one archive (a tar,
    in that order; nothing sent from here), served to token holders until the block ends: then the server stops and
    the archive is removed. RelayError: the node could not pack or serve them."""
    def pack(path: str) -> tuple[int, str]:
        res = conn.run(["python3", "-c", RELAY_SCRIPT, "pack", path, folder, *names], timeout=LOAD_S)
        size, _, sha256 = res.out.strip().partition(" ")
        if res.rc != 0 or not size.isdigit():
            raise RelayError(_why(res.err, res.rc))
        return int(size), sha256

    with _serving_made(conn, pack, what) as served:
        yield served


@contextmanager
def _serving_made(conn: Connection, make: Callable[[str], tuple[int, str]], what: str) -> Iterator[Served]:
    """The archive made at a new path of the node's relay folder by `make` (which returns its size and sha256),
    then served until the block ends; the server stopped and the file removed after, or when it fails."""
    token = secrets.token_hex(16)
    path = f"{conn.identity().home}/{RELAY_DIR}/{what}-{token[:12]}.tar"
    try:
        size, sha256 = make(path)
        chan, port = _serve(conn, path, token)
    except SSHError as err:
        _remove(conn, path)
        raise RelayError(str(err)) from None
    try:
        yield Served(port, token, size, sha256)
    finally:
        _stop(chan)
        _remove(conn, path)


@dataclass(frozen=True)
class Failed:
    """Why a fetch failed; rc: the script's exit code (None: the SSH session to the node failed)."""

    why: str
    rc: int | None = None


def _fetch(there: Connection, served: Served, address: str, land: Sequence[str], keep: str | None) -> Failed | None:
    """The node behind `there` fetches the served archive from `address`, checks its size and sha256, lands it (or,
    with `keep`, keeps it there unlanded, to serve it on: see `_land`)."""
    argv = ["keep", keep] if keep else ["fetch", f"{there.identity().home}/{RELAY_DIR}", *land]
    try:
        res = there.run(["python3", "-c", RELAY_SCRIPT, argv[0], address, str(served.port), served.sha256,
                         str(served.size), *argv[1:]], env=_docker_env(there),
                        timeout=LOAD_S, stdin=served.token.encode() + b"\n")
    except SSHError as err:
        return Failed(str(err))
    return Failed(_why(res.err, res.rc), res.rc) if res.rc != 0 else None


def _land(conn: Connection, path: str, land: Sequence[str]) -> Failed | None:
    """The archive kept at `path` on the node landed there (`land` reads it on stdin)."""
    try:
        landed = conn.run(["sh", "-c", 'f=$1; shift; "$@" < "$f"', "land", path, *land], env=_docker_env(conn),
                          timeout=LOAD_S)
    except SSHError as err:
        return Failed(str(err))
    return Failed(f"{FETCH_EXITS[5]}: {_why(landed.err, landed.rc)}", 5) if landed.rc != 0 else None


def fetch_from(there: Connection, served: Served, address: str, land: Sequence[str]) -> str | None:
    """The node behind `there` fetches the served archive from `address`, checks its size and sha256, lands it.
    Returns None, or why it could not (the caller sends it the bytes from here)."""
    failed = _fetch(there, served, address, land, None)
    return failed.why if failed else None


@dataclass(frozen=True)
class Upstream:
    """A node that serves the archive: its rank, the address the nodes reach it at, what it serves."""

    rank: int
    address: str
    served: Served


R = TypeVar("R")


class RelayTree:
    """The plan's tree carried out for one archive, whose relay node serves it already (`root`): each fetching node
    with children in the plan keeps the archive and serves it once it holds it; every server is stopped and its file
    removed when `stack` closes. `what` starts the lines said (`say`): "image NAME" or "data"."""

    def __init__(self, plan: RelayPlan, root: Served, conn_of: Callable[[int], Connection],
                 address_of: Callable[[int], str], label_of: Callable[[int], str], say: Callable[[str], None],
                 stack: ExitStack, what: str) -> None:
        assert plan.relay is not None
        self.plan, self.conn_of, self.address_of, self.label_of = plan, conn_of, address_of, label_of
        self.say, self.stack, self.what = say, stack, what
        self.serving: dict[int, Upstream] = {plan.relay: Upstream(plan.relay, address_of(plan.relay), root)}
        self.down: dict[int, str] = {}  # per fetching node that serves nobody: why
        self.settled = {rank: threading.Event() for rank in plan.fetch}  # set once it serves, or will not
        self.lock = threading.Lock()

    def walk(self, work: Callable[[int], R], phase: str) -> dict[int, R]:
        """`work` on every fetching node (it calls `fetch`), in parallel; a node's children start once it serves
        (or its work ended without serving: an ancestor serves them). Every failure is reported (MultiHostError),
        each node's children visited all the same."""
        results: dict[int, R] = {}

        def visit(rank: int) -> None:
            failed: list[Exception] = []

            def below() -> None:
                self.settled[rank].wait()
                try:
                    fan_out(phase, list(self.plan.children(rank)), visit, self.label_of)
                except Exception as err:  # re-raised by visit, after its own work's
                    failed.append(err)

            children = threading.Thread(target=below, daemon=True)
            children.start()
            try:
                results[rank] = work(rank)
            except Exception as err:  # its children are still served, by an ancestor; re-raised below
                failed.insert(0, err)
                with self.lock:
                    self.down.setdefault(rank, str(err) or type(err).__name__)
            finally:
                self.settled[rank].set()
            children.join()
            if failed:
                raise failed[0]

        assert self.plan.relay is not None
        fan_out(phase, list(self.plan.children(self.plan.relay)), visit, self.label_of)
        return results

    def _upstreams(self, rank: int) -> list[Upstream]:
        """The nearest two ancestors that serve, nearest first; says so when the planned parent is not one."""
        with self.lock:
            ups = [self.serving[a] for a in self.plan.ancestors(rank) if a in self.serving][:2]
            parent = self.plan.parent(rank)
            why = self.down.get(parent, "it did not fetch the archive") if parent is not None and \
                parent not in self.serving else None
        if why is not None and ups and parent is not None:
            self.say(f"{self.what} on {self.label_of(rank)}: fetching from the relay on "
                     f"{self.label_of(ups[0].rank)} instead of {self.label_of(parent)}, which does not serve ({why})")
        return ups

    def fetch(self, rank: int, land: Sequence[str]) -> tuple[str, str | None]:
        """Node `rank` fetches the archive from the nearest ancestor that serves (once more from the next one up
        when that server cannot be reached or sends wrong bytes) and lands it; when it has children, it serves the
        checked archive to them from before it lands it.
        Returns the label of the node it fetched from (or tried last), and None or why it could not."""
        try:
            return self._fetch_via(rank, land)
        finally:
            self.settled[rank].set()

    def _fetch_via(self, rank: int, land: Sequence[str]) -> tuple[str, str | None]:
        ups = self._upstreams(rank)
        keep = self._keep_path(rank) if self.plan.children(rank) else None
        failed = Failed("no node serves it")
        for n, up in enumerate(ups):
            failed_here = _fetch(self.conn_of(rank), up.served, up.address, land, keep)
            if failed_here is None and keep is not None:
                self._serve_on(rank, up.served, keep)  # its children fetch while it lands
                self.settled[rank].set()
                failed_here = _land(self.conn_of(rank), keep, land)
                if failed_here is not None:  # it serves all the same: the bytes it holds were checked
                    return self.label_of(up.rank), failed_here.why
            if failed_here is None:
                return self.label_of(up.rank), None
            failed = failed_here
            if failed.rc not in RETRY_UP or n + 1 == len(ups):
                break
            self.say(f"{self.what} on {self.label_of(rank)}: could not fetch from the relay on "
                     f"{self.label_of(up.rank)} ({failed.why}); fetching from the relay on {self.label_of(ups[n + 1].rank)}")
        with self.lock:
            self.down.setdefault(rank, f"it could not fetch: {failed.why}")
        return self.label_of(ups[-1].rank) if ups else "?", failed.why

    def _keep_path(self, rank: int) -> str:
        token = next(iter(self.serving.values())).served.token  # one token for the whole tree
        return f"{self.conn_of(rank).identity().home}/{RELAY_DIR}/{self.what.split()[0]}-{token[:12]}-n{rank}.tar"

    def _serve_on(self, rank: int, served: Served, path: str) -> None:
        """The node's server started on the archive it kept (stopped, the file removed, when the stack closes)."""
        conn = self.conn_of(rank)
        try:
            chan, port = _serve(conn, path, served.token)
        except (RelayError, SSHError) as err:  # the file stays until it is landed, removed at the end
            with self.lock:
                self.stack.callback(_remove, conn, path)
                self.down[rank] = str(err)
            return
        with self.lock:
            self.stack.callback(_remove, conn, path)
            self.stack.callback(_stop, chan)
            self.serving[rank] = Upstream(rank, self.address_of(rank), dataclasses.replace(served, port=port))


def relay(nodes: Session, plan: RelayPlan, chunks: Iterator[bytes], address_of: Callable[[int], str],
          say: Callable[[str], None], name: str) -> Relayed:
    """Send `chunks` (the image archive) to the relay node, load it there, and have the plan's other nodes fetch and
    load it, down the plan's tree; `address_of(rank)`: a node's address as the other nodes reach it. RelayError:
    the relay node failed (nothing fetched); a node whose fetch failed is in the result's `unfetched`, with why."""
    assert plan.relay is not None
    unfetched: dict[int, str] = {}
    via: dict[int, str] = {}
    with ExitStack() as stack:
        served = stack.enter_context(serving(nodes.conn(plan.relay), chunks, LOAD_IMAGE, "image"))
        tree = RelayTree(plan, served, nodes.conn, address_of, lambda r: nodes.hosts[r].label, say, stack,
                         f"image {name}")

        def fetch(rank: int) -> None:
            via[rank], why = tree.fetch(rank, LOAD_IMAGE)
            if why is not None:
                unfetched[rank] = why

        tree.walk(fetch, "image relay")
    return Relayed(served.size, via, unfetched)


def _remove(conn: Connection, path: str) -> None:
    """The archive removed from the relay node (the server removes it too): best effort, a lost node keeps it
    until its next relay's folder is cleaned by hand."""
    try:
        conn.run(["rm", "-f", "--", path], timeout=30)
    except SSHError:
        pass


def relay_address(nodes: Session, rank: int, master: str) -> str:
    """Where the other nodes reach the relay node: node 0 at the rendezvous address, another at the address this
    machine reached it."""
    return master.rsplit(":", 1)[0] if rank == 0 else nodes.conn(rank).peer_address


def relayed_line(name: str, label: str, via: str, layers_got: int, layers: int) -> str:
    """The line of a node that got its layers from the relay: nothing sent from here."""
    return f"image {name} on {label}: {layers_got} of {layers} layers fetched from the relay on {via}, 0 MB sent from here"


def fallback_line(name: str, label: str, via: str, why: str) -> str:
    return f"image {name} on {label}: could not fetch from the relay on {via} ({why}); sending its layers from here"

