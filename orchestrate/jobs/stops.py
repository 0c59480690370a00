"""The stop record: how a `kill` typed on any machine reaches an `up` of the job waiting to restart it.

Between two attempts (the restart backoff) no container runs, so the labels have nothing to say and a `kill` finds
nothing to stop. So `kill` first leaves a stop record on every host it reaches, in the login's job folder there
(`~/.local/share/ddp-cifar/jobs/JOB/stop`, written atomically), then stops the job's containers. An `up` looks for
it through its scheduler (Scheduler.stop_record_seen; Docker over SSH: backends/docker_ssh/stoprecord.py): once a
second during the backoff, once more right after each attempt's containers started, and when a running attempt's
nodes exit or are removed (a kill's SIGTERM: the attempt ends as killed, not failed, and is not restarted). The record is per login (its
home): another account's `up` of a job of the same name is never stopped.

Races, and why none loses a kill:
- A kill during the backoff: its record is on the hosts before it lists containers; the poll sees it within a
  second and `up` ends without starting anything.
- A kill between the backoff's last poll and the next attempt's start: `up` looks again once its containers have
  started. Either the kill listed the containers after they were created (it stops them: `up` sees them removed,
  which is never restarted), or it listed them before, and then its record was written before they were created,
  so the look after the start finds it (`up` removes them and ends).
- A stale record from an earlier kill: the first attempt of an `up` removes the record before it starts anything,
  so only a kill typed while this `up` runs counts. A kill that overlaps that very removal may be lost (it then
  prints that it found no container, and the user sees the job start).
- A host unreachable during a poll: that host's answer is "no record"; the poll goes on with the others.
"""

from __future__ import annotations

from orchestrate import pauses

POLL_S = 1.0  # the backoff looks this often: each look is one exec per host, in parallel


def before_restart_starts(attempt: int) -> None:
    """A restart (not the first attempt) calls the installed Pauses (orchestrate/pauses.py) at the moment a kill
    races it: after the backoff's last look, before its containers exist."""
    if attempt:
        pauses.installed().before_restart_starts()
