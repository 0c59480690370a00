"""The relay tree carried out (orchestrate/backends/docker_ssh/relay.py, RelayTree), the nodes replaced by fakes: each
node fetches from its planned parent, and only once that parent holds the archive and serves it; a node whose parent
could not fetch or serve fetches from the next ancestor up, one line saying why; a parent that breaks off is
retried once from the next one up; a parent serves its children while it lands the archive itself; what still
fails is left to the caller (sent from here); every server is stopped at the end. The real script's `keep`: tests/orchestrate/test_relay_script.py."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrate.backends.docker_ssh import relay
from orchestrate.backends.docker_ssh.relay import Failed, RelayTree, Served
from orchestrate.plan.relay import plan_relay

ROOT = Served(9000, "t" * 32, 30, "digest")


class Nodes:
    """Fake nodes: who fetched from whose port, which servers started and stopped; `failing`: per rank, how its own
    fetch fails; `broken`: the ranks whose server breaks off mid-transfer; `no_server`: servers that do not start."""

    def __init__(self, failing: dict[int, Failed] | None = None, broken: frozenset[int] = frozenset(),
                 no_server: frozenset[int] = frozenset(), land_fails: frozenset[int] = frozenset()) -> None:
        self.failing, self.broken, self.no_server, self.land_fails = failing or {}, broken, no_server, land_fails
        self.landed: list[int] = []
        self.child_fetched = threading.Event()  # node 5 (a child of node 1) has fetched
        self.got_from: dict[int, list[int]] = {}
        self.holds: set[int] = {0}
        self.started: list[int] = []
        self.stopped: list[int] = []
        self.lock = threading.Lock()

    def conn(self, rank: int) -> Any:
        return SimpleNamespace(rank=rank, identity=lambda: SimpleNamespace(home=f"/home/n{rank}"))

    def fetch(self, conn: Any, served: Served, address: str, land: list[str], keep: str | None) -> Failed | None:
        server = served.port - 9000
        with self.lock:
            assert server in self.holds, f"node {conn.rank} fetched from {server} before it held the archive"
            self.got_from.setdefault(conn.rank, []).append(server)
        if server in self.broken:
            return Failed(f"the relay 10.0.0.{server}:{served.port} broke off after 5 bytes", 3)
        if conn.rank in self.failing:
            return self.failing[conn.rank]
        assert keep == (f"/home/n{conn.rank}/.cache/ddp-cifar/relay/image-tttttttttttt-n{conn.rank}.tar"
                        if conn.rank in (1, 2, 3) else None)
        with self.lock:
            self.holds.add(conn.rank)
        if keep is None:  # a leaf: the script lands it
            self.landed.append(conn.rank)
        if conn.rank == 5:
            self.child_fetched.set()
        return None

    def land(self, conn: Any, path: str, land: list[str]) -> Failed | None:
        """A parent's own load of the archive it kept: node 1's waits (bounded) until its child 5 has fetched."""
        assert path.endswith(f"-n{conn.rank}.tar") and land == ["docker", "load", "-q"]
        if conn.rank == 1:
            assert self.child_fetched.wait(10), "node 1's children waited for its own load"
        self.landed.append(conn.rank)
        return Failed("the node could not load them: no space left on device", 5) if conn.rank in self.land_fails \
            else None

    def serve(self, conn: Any, path: str, token: str) -> tuple[Any, int]:
        if conn.rank in self.no_server:
            raise relay.RelayError("the relay server did not start (no python3?)")
        self.started.append(conn.rank)
        return SimpleNamespace(rank=conn.rank), 9000 + conn.rank


def _walk(monkeypatch: pytest.MonkeyPatch, nodes: Nodes, n: int = 16) -> tuple[dict[int, tuple[str, str | None]],
                                                                             list[str]]:
    monkeypatch.setattr(relay, "_fetch", nodes.fetch)
    monkeypatch.setattr(relay, "_serve", nodes.serve)
    monkeypatch.setattr(relay, "_land", nodes.land)
    monkeypatch.setattr(relay, "_stop", lambda chan: nodes.stopped.append(chan.rank))
    monkeypatch.setattr(relay, "_remove", lambda conn, path: None)
    plan = plan_relay("on", dict.fromkeys(range(n), 0))
    lines: list[str] = []
    with ExitStack() as stack:
        tree = RelayTree(plan, ROOT, nodes.conn, lambda r: f"10.0.0.{r}", lambda r: f"h{r}", lines.append, stack,
                         "image x")
        results = tree.walk(lambda r: tree.fetch(r, ["docker", "load", "-q"]), "image relay")
        assert nodes.stopped == []  # the servers run until the whole tree is done
    return results, lines


def test_sixteen_nodes_fetch_from_their_parents_once_these_hold_it(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes()
    results, lines = _walk(monkeypatch, nodes)
    assert {r: got[0] for r, got in nodes.got_from.items()} == {r: 0 if r <= 4 else (r - 1) // 4 for r in range(1, 16)}
    assert results == {r: (f"h{0 if r <= 4 else (r - 1) // 4}", None) for r in range(1, 16)} and lines == []
    assert sorted(nodes.started) == [1, 2, 3] and sorted(nodes.stopped) == [1, 2, 3]  # only the nodes with children
    assert sorted(nodes.landed) == list(range(1, 16))


def test_a_node_that_could_not_fetch_leaves_its_children_to_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(failing={1: Failed("cannot connect to 10.0.0.0:9000: No route to host", 3)})
    results, lines = _walk(monkeypatch, nodes)
    assert results[1] == ("h0", "cannot connect to 10.0.0.0:9000: No route to host")  # the caller sends it
    assert nodes.got_from[1] == [0]  # nobody above the relay to try
    assert [nodes.got_from[r] for r in (5, 6, 7, 8)] == [[0]] * 4 and results[5] == ("h0", None)
    assert sorted(lines) == [f"image x on h{r}: fetching from the relay on h0 instead of h1, which does not serve (it "
                             "could not fetch: cannot connect to 10.0.0.0:9000: No route to host)" for r in (5, 6, 7, 8)]


def test_a_node_that_could_not_load_still_serves_the_checked_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(land_fails=frozenset({1}))
    results, lines = _walk(monkeypatch, nodes)
    assert results[1] == ("h0", "the node could not load them: no space left on device") and nodes.got_from[1] == [0]
    assert [nodes.got_from[r] for r in (5, 6, 7, 8)] == [[1]] * 4 and lines == []


def test_a_parent_that_breaks_off_is_retried_once_from_the_next_one_up(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(broken=frozenset({2}))
    results, lines = _walk(monkeypatch, nodes)
    assert [nodes.got_from[r] for r in (9, 10, 11, 12)] == [[2, 0]] * 4
    assert [results[r] for r in (9, 12)] == [("h0", None)] * 2 and results[13] == ("h3", None)
    assert sorted(lines) == [f"image x on h{r}: could not fetch from the relay on h2 (the relay 10.0.0.2:9002 broke "
                             "off after 5 bytes); fetching from the relay on h0" for r in (10, 11, 12, 9)]


def test_a_server_that_does_not_start_leaves_its_children_to_the_next_one_up(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(no_server=frozenset({3}))
    results, lines = _walk(monkeypatch, nodes)
    assert results[3] == ("h0", None)  # it holds the image all the same
    assert [nodes.got_from[r] for r in (13, 14, 15)] == [[0]] * 3
    assert sorted(lines) == [f"image x on h{r}: fetching from the relay on h0 instead of h3, which does not serve (the "
                             "relay server did not start (no python3?))" for r in (13, 14, 15)]


def test_what_fails_from_the_relay_itself_is_left_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(broken=frozenset({0}))
    results, lines = _walk(monkeypatch, nodes, n=4)  # flat: nobody further up to try
    assert results == {r: ("h0", "the relay 10.0.0.0:9000 broke off after 5 bytes") for r in (1, 2, 3)}
    assert lines == []
