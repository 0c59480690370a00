"""Ports for the tests' own listeners and process groups."""

from __future__ import annotations

import socket


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free on `addr` now: nothing listens there once this returns (a refused connection, or a
    port for a listener the test starts next)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
