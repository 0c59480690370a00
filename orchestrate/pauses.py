"""Pauses: the points in `up` where a program that embeds the CLI may hold it, each a no-op here.

Two moments of `up` are races with another process: a `kill` typed between the restart backoff's last look for a
stop record and the start of the restart's containers (jobs/stops.py), and another `up` claiming the same GPUs
between this one's choice of a GPU set and the creation of its containers (backends/docker_ssh/claim.py). A program
that wants to land on one of them every time (to check what `up` does there) subclasses Pauses, installs it, then
calls orchestrate.cli.main: tests/kit/gated_orchestrate.py does so. `python -m orchestrate` installs none.
"""

from __future__ import annotations


class Pauses:
    """Called by `up` at the moments named by each method; each returns to let `up` go on."""

    def before_restart_starts(self) -> None:
        """A restart (never the first attempt): after the backoff's last look for a stop record, before its
        containers are created."""

    def before_claim(self) -> None:
        """Each start: after the plan chose the GPU sets and the master port, before the containers that claim
        them are created."""


_installed = Pauses()


def install(pauses: Pauses) -> None:
    """Use `pauses` from now on in this process (before orchestrate.cli.main is called)."""
    global _installed
    _installed = pauses


def installed() -> Pauses:
    """The Pauses `up` calls: the no-op one unless a program installed its own."""
    return _installed
