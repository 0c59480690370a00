"""The image layers relayed inside the cluster (`--relay`, plan/relay.py decides who gets what from where).

The same mechanism carries the `--data-from` files (staging.py): only what lands the archive differs.

One archive (the layers the node holding the fewest lacks) goes from here to the relay node over SSH, into a file
in its ~/.cache/ddp-cifar/relay, its sha256 computed here as it goes; the relay node loads it. Then a stdlib
server (remote/scripts/relay.py, the host's python3) serves that file on a free port of the relay node, to clients
that present a random token; each other node fetches it (the same script, started over SSH), checks its size and
sha256 before `docker load`, and removes it. The server runs in the foreground of one SSH channel: when delivery
ends (or this process dies), the channel closes, the server removes the file and exits. No node logs in to
another; nothing is left running. A node whose fetch fails is reported, and the caller sends it its layers from
here.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import paramiko

from orchestrate.errors import SSHError
from orchestrate.plan.relay import RelayPlan
from orchestrate.remote import scripts
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import Connection, fan_out, quote_command

RELAY_SCRIPT = scripts.text("relay.py")
RELAY_DIR = ".cache/ddp-cifar/relay"
SERVER_START_S = 30.0
SERVER_END_S = 15.0
LOAD_S = 3600.0
LOAD_IMAGE = ("docker", "load", "-q")  # how a node lands the image archive (on its stdin)
FETCH_EXITS = {3: "cannot reach the relay", 4: "the bytes fetched do not match", 5: "the node could not load them",
               127: "no python3 on the node"}


class RelayError(SSHError):
    """The relay node could not be sent, load or serve the archive (the caller sends every node its layers)."""


@dataclass
class Relayed:
    """What the relay did: bytes sent from here (to the relay node only), and per node that fetched nothing, why."""

    sent: int
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
    token = secrets.token_hex(16)
    folder = f"{conn.identity().home}/{RELAY_DIR}"
    path = f"{folder}/{what}-{token[:12]}.tar"
    try:
        conn.run(["mkdir", "-p", "--", folder], timeout=30, check=True)
        size, sha256 = _put(conn, chunks, path)
        landed = conn.run(["sh", "-c", 'f=$1; shift; "$@" < "$f"', "land", path, *land], env=_docker_env(conn),
                          timeout=LOAD_S)
        if landed.rc != 0:
            raise RelayError(f"{land[0]} of the archive failed: {_why(landed.err, landed.rc)}")
        chan, port = _serve(conn, path, token)
    except SSHError as err:
        _remove(conn, path)
        raise RelayError(str(err)) from None
    try:
        yield Served(port, token, size, sha256)
    finally:
        _stop(chan)
        _remove(conn, path)


def fetch_from(there: Connection, served: Served, address: str, land: Sequence[str]) -> str | None:
    """The node behind `there` fetches the served archive from `address`, checks its size and sha256, lands it.
    Returns None, or why it could not (the caller sends it the bytes from here)."""
    try:
        res = there.run(["python3", "-c", RELAY_SCRIPT, "fetch", address, str(served.port), served.sha256,
                         str(served.size), f"{there.identity().home}/{RELAY_DIR}", *land], env=_docker_env(there),
                        timeout=LOAD_S, stdin=served.token.encode() + b"\n")
    except SSHError as err:
        return str(err)
    return _why(res.err, res.rc) if res.rc != 0 else None


def relay(nodes: Session, plan: RelayPlan, chunks: Iterator[bytes], address: str) -> Relayed:
    """Send `chunks` (the image archive) to the relay node, load it there, and have the plan's other nodes fetch and
    load it; `address`: the relay node's address as the nodes reach it. RelayError: the relay node failed (nothing
    fetched); a node whose fetch failed is in the result's `unfetched`, with why."""
    assert plan.relay is not None
    unfetched: dict[int, str] = {}
    with serving(nodes.conn(plan.relay), chunks, LOAD_IMAGE, "image") as served:
        def fetch(rank: int) -> None:
            why = fetch_from(nodes.conn(rank), served, address, LOAD_IMAGE)
            if why is not None:
                unfetched[rank] = why

        fan_out("image relay", list(plan.fetch), fetch, lambda r: nodes.hosts[r].label)
    return Relayed(served.size, unfetched)


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

