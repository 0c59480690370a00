"""PURE: what follows a failed attempt: restart (after a backoff), wait for every host first, restart on fewer hosts
(--min-nodes), or give up, and why. The one place this is decided; the pipeline carries it out (restart.py waits
out the backoff and looks for a kill meanwhile, the scheduler waits for the hosts: Scheduler.await_hosts,
pipeline/ready.py leaves the hosts out). The stories it answers are docs/what-happens-when.md's."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.config import Resilience
from orchestrate.outcome import End, Outcome

MAX_BACKOFF_FACTOR = 6  # --restart-backoff doubled at each further restart, at most this many times itself
BACK_WAIT_S = 120.0  # a restart waits this long at most for a rebooted host or a stopped daemon to answer again
# Failures of the job itself; a user's kill or Ctrl-C is never undone by a restart.
RESTARTABLE = frozenset({End.EXITED, End.UNREACHABLE, End.STALLED, End.HOST})


@dataclass(frozen=True)
class AttemptResult:
    """How one start of the job ended (an automatic restart is another attempt)."""

    outcome: Outcome
    resumed_from: int | None = None  # the checkpoint step it started from (None: from scratch)
    newest_step: int | None = None  # the newest valid checkpoint when it ended (None: none)

    @property
    def progressed(self) -> bool:
        return self.newest_step is not None and self.newest_step != self.resumed_from


@dataclass(frozen=True)
class Reachable:
    """The hosts a restart found usable: their indices among the `total` hosts, and what they passed ("reachable":
    they answered the connect; "passed preflight")."""

    hosts: tuple[int, ...]
    total: int
    what: str


class Next(enum.Enum):
    RESTART = "restart"  # the next attempt, on every host (after the backoff)
    WAIT_FOR_HOSTS = "wait for hosts"  # after the backoff, until every host answers (at most wait_s), then restart
    SHRINK = "shrink"  # the next attempt on the hosts kept (--min-nodes)
    GIVE_UP = "give up"


@dataclass(frozen=True)
class Decision:
    next: Next
    why: str  # GIVE_UP: the error line; else the line `up` prints
    backoff_s: float = 0.0  # before the next attempt (a kill or Ctrl-C meanwhile ends it all)
    wait_s: float = 0.0  # WAIT_FOR_HOSTS: at most this long
    keep: tuple[int, ...] = ()  # SHRINK: the hosts the next attempt runs on


def decide(job: str, history: Sequence[AttemptResult], ended: AttemptResult, reachable: Reachable | None,
           resilience: Resilience) -> Decision:
    """PURE: what follows attempt `ended` (the attempts before it: `history`, first start first), given the hosts a
    restart found usable (`reachable`; None: not looked at yet, right after the attempt ended)."""
    number, outcome = len(history), ended.outcome
    failure = _failure_text(job, outcome)
    if outcome.end not in RESTARTABLE or number >= resilience.max_restarts:
        used = f" (after {number} automatic restart(s))" if number else ""
        return Decision(Next.GIVE_UP, failure + used)
    # The same kind of failure, and not one new checkpoint since the last: restarting again would repeat it. The
    # node named may differ (when one rank crashes its peers exit too, and which exit is seen first varies).
    if history and not ended.progressed and history[-1].outcome.end is outcome.end:
        since = "" if ended.resumed_from is None else f" (step {ended.resumed_from})"
        return Decision(Next.GIVE_UP, f"{failure}; the same failure repeated before any new checkpoint was written"
                                      f"{since}: not restarting again, fix the cause then 'up --resume'")
    backoff = resilience.restart_backoff * min(2 ** number, MAX_BACKOFF_FACTOR)
    line = (f"restart {number + 1} of {resilience.max_restarts} in {backoff:g} s, from the newest valid checkpoint; "
            f"cause: {outcome.cause}")
    if not resilience.min_nodes:
        # Every host is needed: a rebooting host or a restarting daemon is waited for. Also after another node's
        # exit: a host going down is often first seen as its peers losing contact.
        return Decision(Next.WAIT_FOR_HOSTS, line, backoff, wait_s=BACK_WAIT_S)
    if reachable is None or len(reachable.hosts) == reachable.total:
        return Decision(Next.RESTART, line, backoff)
    if len(reachable.hosts) < resilience.min_nodes:
        return Decision(Next.GIVE_UP, f"restart {number + 1}: only {len(reachable.hosts)} host(s) {reachable.what}, "
                                      f"fewer than --min-nodes {resilience.min_nodes}; the job was stopped on all "
                                      "nodes; fix the hosts, then 'up --resume'")
    return Decision(Next.SHRINK, line, backoff, keep=reachable.hosts)


def _failure_text(job: str, outcome: Outcome) -> str:
    if outcome.end is End.KILLED:
        return f"job {job!r} was stopped with 'kill' while it ran; nothing runs, no restart follows"
    cleaned = (f"stopped where reachable; run 'kill --job {job}' once all hosts answer"
               if outcome.leftovers else "the job was stopped on all nodes")
    return f"job {job!r} failed: {outcome.cause}; {cleaned}"
