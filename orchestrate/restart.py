"""The restart policy of `up`: after a failed attempt, raise the failure or wait out the backoff before the next
attempt (--max-restarts); a `kill` from any machine or Ctrl-C during the backoff ends it all."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console

from orchestrate.config import Program, Resilience, SSHOptions
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.jobs import stops
from orchestrate.remote.session import Session
from orchestrate.watch.outcome import Outcome

BACKOFF_S = 10.0  # before the first automatic restart; doubled each time, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 60.0
KILLED_IN_BACKOFF = "job {job!r} was stopped with 'kill' during the restart backoff; nothing runs, no restart follows"


@dataclass
class AttemptResult:
    """How one start of the job ended (an automatic restart is another attempt)."""

    outcome: Outcome
    resumed_from: int | None = None  # the checkpoint step it started from (None: from scratch)
    newest_step: int | None = None  # the newest valid checkpoint when it ended (None: none)

    @property
    def progressed(self) -> bool:
        return self.newest_step is not None and self.newest_step != self.resumed_from


def restart_or_raise(program: Program, resilience: Resilience, ssh: SSHOptions, number: int, attempt: AttemptResult,
                     previous: AttemptResult | None, hosts: list[Host], console: Console) -> None:
    """Raise the job's failure unless an automatic restart is due after attempt `number` (0: the first start);
    then wait out the backoff (a `kill` from any machine, seen as its stop record on the hosts, or Ctrl-C
    meanwhile ends it all)."""
    outcome = attempt.outcome
    failure = _failure_text(program, outcome)
    if not outcome.end.restartable or number >= resilience.max_restarts:
        used = f" (after {number} automatic restart(s))" if number else ""
        raise JobError(failure + used)
    # The same kind of failure, and not one new checkpoint since the last: restarting again would repeat it. The
    # node named may differ (when one rank crashes its peers exit too, and which exit is seen first varies).
    if previous is not None and not attempt.progressed and previous.outcome.end is outcome.end:
        since = "" if attempt.resumed_from is None else f" (step {attempt.resumed_from})"
        raise JobError(f"{failure}; the same failure repeated before any new checkpoint was written{since}: not "
                       "restarting again, fix the cause then 'up --resume'")
    wait = min(BACKOFF_S * 2 ** number, MAX_BACKOFF_S)
    console.print(f"restart {number + 1} of {resilience.max_restarts} in {wait:.0f} s, from the newest valid "
                  f"checkpoint; cause: {outcome.cause}", markup=False, highlight=False)
    try:  # from the line above on: a Ctrl-C while the connections open is one during the backoff too
        _look_for_a_kill(program.job, ssh, hosts, time.monotonic() + wait)
    except KeyboardInterrupt:
        raise JobError(f"job {program.job!r}: Ctrl-C during the restart backoff; nothing runs, no restart "
                       "follows") from None


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


def _failure_text(program: Program, outcome: Outcome) -> str:
    cleaned = (f"stopped where reachable; run 'kill --job {program.job}' once all hosts answer"
               if outcome.leftovers else "the job was stopped on all nodes")
    return f"job {program.job!r} failed: {outcome.cause}; {cleaned}"

