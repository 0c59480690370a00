"""The --data-from relay's decisions (orchestrate/backends/docker_ssh/datasync.py), the nodes replaced by fakes: the
files any node lacks go once to the relay node, the others fetch them, a node that cannot fetch is sent its files
from here with one line saying why, and a relay node that fails means every node is sent its files from here. The
real transfer, its digests and bytes on the wire: tests/cluster/test_image_relay.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrate.backends.docker_ssh import datasync, relay
from orchestrate.backends.docker_ssh.relay import RelayError, Served
from orchestrate.backends.docker_ssh.staging import Entry, Put, StageResult

LOCAL = {"a.bin": Entry(10, "aa"), "b.bin": Entry(20, "bb")}


def _conns(n: int) -> list[Any]:
    return [SimpleNamespace(host=SimpleNamespace(label=f"h{i}")) for i in range(n)]


def _run(monkeypatch: pytest.MonkeyPatch, n: int, mode: str, unreachable: set[int] = frozenset(),  # type: ignore[assignment]
         relay_fails: bool = False) -> tuple[dict[int, StageResult], list[str], dict[str, list[int]]]:
    conns, seen = _conns(n), {"served": [], "fetched": [], "direct": []}
    monkeypatch.setattr(datasync, "node_state", lambda conn, d: {})  # every node lacks every file
    monkeypatch.setattr(datasync, "check_space", lambda conn, d, need: None)

    @contextmanager
    def serving(conn: Any, chunks: Iterator[bytes], land: list[str], what: str) -> Iterator[Served]:
        if relay_fails:
            raise RelayError("docker load of the archive failed")
        seen["served"].append(int(conn.host.label[1:]))
        yield Served(1234, "token", 30, "digest")

    def fetch(conn: Any, served: Served, address: str, land: list[str], keep: str | None) -> relay.Failed | None:
        rank = int(conn.host.label[1:])
        seen["fetched"].append(rank)
        return relay.Failed("cannot reach the relay: connection refused", 3) if rank in unreachable else None

    monkeypatch.setattr(datasync, "serving", serving)
    monkeypatch.setattr(relay, "_fetch", fetch)
    monkeypatch.setattr(datasync, "send_changed", lambda conn, *a: seen["direct"].append(int(conn.host.label[1:])))
    monkeypatch.setattr(datasync, "tar_stream", lambda *a: iter(()))

    def stage(i: int, put: Put | None) -> StageResult:
        changed = sorted(LOCAL)
        if put is None:
            seen["direct"].append(i)
            return StageResult(f"h{i}", 2, changed, 30)
        via = put(changed, 30)
        return StageResult(f"h{i}", 2, changed, 0 if via else 30, via)

    lines: list[str] = []
    results = datasync.relay_data(conns, [f"/d{i}" for i in range(n)], list(range(n)), LOCAL, Path("/src"), mode,
                                  lambda r: "10.0.0.1", stage, lambda i: lambda done, total: None, lines.append)
    return results, lines, seen


def test_the_files_go_once_to_the_relay_node_and_the_others_fetch_them(monkeypatch: pytest.MonkeyPatch) -> None:
    results, lines, seen = _run(monkeypatch, 3, "auto")
    assert seen["served"] == [0] and sorted(seen["fetched"]) == [1, 2] and seen["direct"] == []  # 1 and 2 in parallel
    assert [results[i].via for i in range(3)] == [None, "h0", "h0"]
    assert results[1].describe() == "2 of 2 files changed, fetched from the relay on h0, 0 bytes sent from here"
    assert lines == ["data: 2 files (30 bytes) sent once from here to h0, which serves them to 2 node(s) (--relay auto)"]


def test_a_node_that_cannot_fetch_is_sent_its_files_from_here_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    results, lines, seen = _run(monkeypatch, 3, "auto", unreachable={2})
    assert seen["direct"] == [2] and [results[i].via for i in range(3)] == [None, "h0", None]
    assert lines[-1] == ("data on h2: could not fetch from the relay on h0 (cannot reach the relay: connection "
                         "refused); sending its files from here")


def test_a_relay_node_that_fails_means_every_node_is_sent_its_files(monkeypatch: pytest.MonkeyPatch) -> None:
    results, lines, seen = _run(monkeypatch, 3, "on", relay_fails=True)
    assert sorted(seen["direct"]) == [0, 1, 2] and seen["fetched"] == []
    assert lines == ["data: the relay on h0 failed (docker load of the archive failed); sending each node its files "
                     "from here"]


def test_below_auto_threshold_or_off_every_node_is_sent_its_files(monkeypatch: pytest.MonkeyPatch) -> None:
    for n, mode in ((2, "auto"), (3, "off")):
        results, lines, seen = _run(monkeypatch, n, mode)
        assert sorted(seen["direct"]) == list(range(n)) and seen["served"] == [] and lines == []
