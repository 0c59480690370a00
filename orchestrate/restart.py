"""Carrying out a restart decision (plan/restarts.py): raise its failure, or print its line and wait out its
backoff; a `kill` from any machine (its stop record on the hosts, looked for through the scheduler) or Ctrl-C during
the backoff ends it all."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

from rich.console import Console

from orchestrate.backends.protocol import Scheduler
from orchestrate.config import SSHOptions
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.jobs import stops
from orchestrate.plan.restarts import Decision, Next

NodesT = TypeVar("NodesT")

KILLED_IN_BACKOFF = "job {job!r} was stopped with 'kill' during the restart backoff; nothing runs, no restart follows"


def back_off(decision: Decision, job: str, scheduler: Scheduler[NodesT], ssh: SSHOptions, hosts: Sequence[Host],
             console: Console) -> None:
    """Raise the decision's failure when it gives up; else print its line and wait out its backoff, looking for a
    kill meanwhile."""
    if decision.next is Next.GIVE_UP:
        raise JobError(decision.why)
    console.print(decision.why, markup=False, highlight=False)
    try:  # from the line above on: a Ctrl-C while the connections open is one during the backoff too
        _look_for_a_kill(job, scheduler, ssh, hosts, time.monotonic() + decision.backoff_s)
    except KeyboardInterrupt:
        raise JobError(f"job {job!r}: Ctrl-C during the restart backoff; nothing runs, no restart follows") from None


def _look_for_a_kill(job: str, scheduler: Scheduler[NodesT], ssh: SSHOptions, hosts: Sequence[Host],
                     deadline: float) -> None:
    """Until `deadline`, look for a kill's stop record on the hosts once a second; JobError once one is seen."""
    with scheduler.reach(hosts, ssh) as reached:  # a host still down is not waited for
        while time.monotonic() < deadline:
            looked = time.monotonic()
            if scheduler.stop_record_seen(reached.nodes, job):
                raise JobError(KILLED_IN_BACKOFF.format(job=job))
            time.sleep(max(0.0, min(stops.POLL_S - (time.monotonic() - looked), deadline - time.monotonic())))
