"""Carrying out a restart decision (plan/restarts.py): raise its failure, or print its line and wait out its
backoff; a `kill` from any machine (its stop record on the hosts) or Ctrl-C during the backoff ends it all."""

from __future__ import annotations

import time

from rich.console import Console

from orchestrate.config import SSHOptions
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.jobs import stops
from orchestrate.plan.restarts import Decision, Next
from orchestrate.remote.session import Session

KILLED_IN_BACKOFF = "job {job!r} was stopped with 'kill' during the restart backoff; nothing runs, no restart follows"


def back_off(decision: Decision, job: str, ssh: SSHOptions, hosts: list[Host], console: Console) -> None:
    """Raise the decision's failure when it gives up; else print its line and wait out its backoff, looking for a
    kill meanwhile."""
    if decision.next is Next.GIVE_UP:
        raise JobError(decision.why)
    console.print(decision.why, markup=False, highlight=False)
    try:  # from the line above on: a Ctrl-C while the connections open is one during the backoff too
        _look_for_a_kill(job, ssh, hosts, time.monotonic() + decision.backoff_s)
    except KeyboardInterrupt:
        raise JobError(f"job {job!r}: Ctrl-C during the restart backoff; nothing runs, no restart follows") from None


def _look_for_a_kill(job: str, ssh: SSHOptions, hosts: list[Host], deadline: float) -> None:
    """Until `deadline`, look for a kill's stop record on the hosts once a second; JobError once one is seen."""
    nodes, _ = Session.connect_reachable(hosts, ssh.accept_new_host_keys)  # a host still down is not waited for
    try:
        while time.monotonic() < deadline:
            looked = time.monotonic()
            if stops.seen(nodes, job):
                raise JobError(KILLED_IN_BACKOFF.format(job=job))
            time.sleep(max(0.0, min(stops.POLL_S - (time.monotonic() - looked), deadline - time.monotonic())))
    finally:
        nodes.close()
