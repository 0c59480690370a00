"""The open connections of one command: one SSH connection and one tunnelled Docker client per host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrate.errors import SSHError
from orchestrate.fanout import fan_out
from orchestrate.hosts import Host
from orchestrate.remote.docker import client_over_ssh
from orchestrate.remote.ssh import Connection, connect_all


class Session:
    """One command's session with the hosts: in node-rank order, their connections (None where a host could not be
    reached) and Docker clients."""

    def __init__(self, hosts: Sequence[Host], conns: Sequence[Connection | None]) -> None:
        self.hosts = list(hosts)
        self.conns = list(conns)
        self._clients: dict[tuple[int, float | None], Any] = {}
        self._lost: dict[int, str] = {}

    @classmethod
    def connect(cls, hosts: Sequence[Host], accept_new_host_keys: bool) -> Session:
        """All or nothing: every failing host is reported (for `up`)."""
        return cls(hosts, connect_all(hosts, accept_new_host_keys))

    @classmethod
    def connect_reachable(cls, hosts: Sequence[Host], accept_new_host_keys: bool) -> tuple[Session, dict[str, str]]:
        """Connect what can be reached (for kill/status/logs); return the failures by host label."""
        conns: list[Connection | None] = [None] * len(hosts)
        failures: dict[str, str] = {}

        def one(i: int) -> None:
            try:
                conns[i] = Connection.open(hosts[i], accept_new_host_keys)
            except SSHError as err:
                failures[hosts[i].label] = str(err)

        fan_out("ssh", list(range(len(hosts))), one, lambda i: hosts[i].label)
        return cls(hosts, conns), failures

    def conn(self, rank: int) -> Connection:
        if rank in self._lost:
            raise SSHError(f"{self.hosts[rank].label} unreachable: {self._lost[rank]}")
        conn = self.conns[rank]
        if conn is None:
            raise SSHError(f"{self.hosts[rank].label} is not connected")
        return conn

    def lose(self, rank: int, why: str) -> None:
        """A node found down (it answered nothing for long): every later use of it in this command fails at once
        with `why` instead of waiting out the SSH timeouts again. After a host is lost, stopping the job and
        finding the newest checkpoint each paid 30 s there (3 channel timeouts), the restart a minute later."""
        self._lost[rank] = why

    def lost(self) -> dict[str, str]:
        """The lost nodes' hosts by label, with why (for the failures a stop reports)."""
        return {self.hosts[r].label: f"{self.hosts[r].label} unreachable: {why}" for r, why in self._lost.items()}

    def connected(self) -> list[Connection]:
        """Every node's connection, in rank order (SSHError names a node that has none)."""
        return [self.conn(r) for r in range(len(self.hosts))]

    def docker(self, rank: int, timeout: float | None = 60.0) -> Any:
        """A Docker client for the node, one per read timeout (long for transfers, short for polls)."""
        key = (rank, timeout)
        if key not in self._clients:
            self._clients[key] = client_over_ssh(self.conn(rank), timeout=timeout)
        return self._clients[key]

    def reachable(self) -> list[int]:
        return [i for i, c in enumerate(self.conns) if c is not None and i not in self._lost]

    def close(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception:  # closing is best effort
                pass
        for conn in self.conns:
            if conn is not None:
                conn.close()

