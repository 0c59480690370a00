"""What follows a failed attempt (plan/restarts.py's decide), one row per story of docs/what-happens-when.md, the
failure catalogue; and the backoff carrying it out (restart.py): a kill's stop record ends it all."""

from __future__ import annotations

import io
from pathlib import Path
from typing import NamedTuple

import pytest
from rich.console import Console

from orchestrate import restart
from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.config import Resilience, SSHOptions, UpConfig
from orchestrate.errors import ConfigError, JobError
from orchestrate.outcome import End, Outcome
from orchestrate.plan.restarts import RESTARTABLE, AttemptResult, Decision, Next, Reachable, decide

EXITED = Outcome(False, End.EXITED, 1, "exited with code 1", host="b")
EXITED_ELSEWHERE = Outcome(False, End.EXITED, 0, "exited with code 1", host="a")
CUT_OFF = Outcome(False, End.UNREACHABLE, 0, "host unreachable for 15 s", host="a", leftovers=True)
REBOOTED = Outcome(False, End.HOST, 1, "b rebooted", host="b")
STALLED = Outcome(False, End.STALLED, 1, "stalled: no new step for 15 s", host="b")
REMOVED = Outcome(False, End.REMOVED, 0, "removed")
INTERRUPTED = Outcome(False, End.INTERRUPTED, None, "interrupted (Ctrl-C)")
KILLED = Outcome(False, End.KILLED, None, "stopped with 'kill'")


def resilience(max_restarts: int = 2, min_nodes: int | None = None, **more: object) -> Resilience:
    return UpConfig.of(ssh=SSHOptions(None, None, False), job="j", max_restarts=max_restarts,
                       min_nodes=min_nodes, **more).resilience


class Story(NamedTuple):
    story: str  # the catalogue's words
    history: tuple[AttemptResult, ...]
    ended: AttemptResult
    reachable: Reachable | None
    resilience: Resilience
    expected: Decision


CAUSE = "node 1 (b) exited with code 1"
STORIES = [
    Story("a node's container dies, no --max-restarts: the job stops, `up --resume` finishes it",
          (), AttemptResult(EXITED, None, 8), None, resilience(0),
          Decision(Next.GIVE_UP, f"job 'j' failed: {CAUSE}; the job was stopped on all nodes")),
    Story("a node's container dies with --max-restarts: every host is needed, waited for after the 10 s backoff",
          (), AttemptResult(EXITED, None, 8), None, resilience(),
          Decision(Next.WAIT_FOR_HOSTS, f"restart 1 of 2 in 10 s, from the newest valid checkpoint; cause: {CAUSE}",
                   10.0, 120.0)),
    Story("a rank freezes: the stall is a failure, restarted like an exit; the backoff doubles",
          (AttemptResult(EXITED, None, 8),), AttemptResult(STALLED, 8, 16), None, resilience(),
          Decision(Next.WAIT_FOR_HOSTS, "restart 2 of 2 in 20 s, from the newest valid checkpoint; cause: node 1 (b) "
                   "stalled: no new step for 15 s", 20.0, 120.0)),
    Story("a host reboots under a job: waited for (at most 120 s), then restarted",
          (), AttemptResult(REBOOTED, None, 8), None, resilience(1),
          Decision(Next.WAIT_FOR_HOSTS, "restart 1 of 1 in 10 s, from the newest valid checkpoint; cause: node 1 (b) "
                   "b rebooted", 10.0, 120.0)),
    Story("node 0's host cut off for good, --min-nodes 2: the restart counts the hosts when it connects",
          (), AttemptResult(CUT_OFF, None, 8), None, resilience(1, 2),
          Decision(Next.RESTART, "restart 1 of 1 in 10 s, from the newest valid checkpoint; cause: node 0 (a) host "
                   "unreachable for 15 s", 10.0)),
    Story("node 0's host cut off for good, --min-nodes 2: 2 of 3 answer, the restart runs on them",
          (), AttemptResult(CUT_OFF, None, 8), Reachable((1, 2), 3, "reachable"), resilience(1, 2),
          Decision(Next.SHRINK, "restart 1 of 1 in 10 s, from the newest valid checkpoint; cause: node 0 (a) host "
                   "unreachable for 15 s", 10.0, keep=(1, 2))),
    Story("--min-nodes 2 and every host answers again: the restart runs on all of them",
          (), AttemptResult(CUT_OFF, None, 8), Reachable((0, 1, 2), 3, "reachable"), resilience(1, 2),
          Decision(Next.RESTART, "restart 1 of 1 in 10 s, from the newest valid checkpoint; cause: node 0 (a) host "
                   "unreachable for 15 s", 10.0)),
    Story("--min-nodes 2 and only 1 host passes preflight: nothing starts, fix the hosts then `up --resume`",
          (), AttemptResult(CUT_OFF, None, 8), Reachable((2,), 3, "passed preflight"), resilience(1, 2),
          Decision(Next.GIVE_UP, "restart 1: only 1 host(s) passed preflight, fewer than --min-nodes 2; the job was "
                   "stopped on all nodes; fix the hosts, then 'up --resume'")),
    Story("a crash repeats at the same step: not restarted again, the checkpoint's step named",
          (AttemptResult(EXITED, None, 8),), AttemptResult(EXITED, 8, 8), None, resilience(),
          Decision(Next.GIVE_UP, f"job 'j' failed: {CAUSE}; the job was stopped on all nodes; the same failure repeated "
                   "before any new checkpoint was written (step 8): not restarting again, fix the cause then "
                   "'up --resume'")),
    Story("a crash before the first checkpoint, twice: the second started over, no step to name",
          (AttemptResult(EXITED, None, None),), AttemptResult(EXITED, None, None), None, resilience(),
          Decision(Next.GIVE_UP, f"job 'j' failed: {CAUSE}; the job was stopped on all nodes; the same failure repeated "
                   "before any new checkpoint was written: not restarting again, fix the cause then 'up --resume'")),
    Story("a crash takes its peers down: the same kind on another node is a repeat too",
          (AttemptResult(EXITED, None, 8),), AttemptResult(EXITED_ELSEWHERE, 8, 8), None, resilience(),
          Decision(Next.GIVE_UP, "job 'j' failed: node 0 (a) exited with code 1; the job was stopped on all nodes; "
                   "the same failure repeated before any new checkpoint was written (step 8): not restarting again, "
                   "fix the cause then 'up --resume'")),
    Story("another kind of failure without progress: restarted",
          (AttemptResult(EXITED, None, 8),), AttemptResult(STALLED, 8, 8), None, resilience(),
          Decision(Next.WAIT_FOR_HOSTS, "restart 2 of 2 in 20 s, from the newest valid checkpoint; cause: node 1 (b) "
                   "stalled: no new step for 15 s", 20.0, 120.0)),
    Story("the same failure after a new checkpoint: restarted",
          (AttemptResult(EXITED, None, 8),), AttemptResult(EXITED, 8, 16), None, resilience(),
          Decision(Next.WAIT_FOR_HOSTS, f"restart 2 of 2 in 20 s, from the newest valid checkpoint; cause: {CAUSE}",
                   20.0, 120.0)),
    Story("the restarts are used up: the failure, and how many restarts ran",
          (AttemptResult(EXITED, None, 8), AttemptResult(STALLED, 8, 16)), AttemptResult(EXITED, 16, 24), None,
          resilience(), Decision(Next.GIVE_UP, f"job 'j' failed: {CAUSE}; the job was stopped on all nodes (after 2 "
                                               "automatic restart(s))")),
    Story("a node cut off leaves containers it could not stop: the failure says to kill once all hosts answer",
          (), AttemptResult(CUT_OFF, None, 8), None, resilience(0),
          Decision(Next.GIVE_UP, "job 'j' failed: node 0 (a) host unreachable for 15 s; stopped where reachable; run "
                   "'kill --job j' once all hosts answer")),
    Story("`kill` from another terminal removed a container: never undone by a restart",
          (), AttemptResult(REMOVED, None, 8), None, resilience(),
          Decision(Next.GIVE_UP, "job 'j' failed: node 0 removed; the job was stopped on all nodes")),
    Story("`kill` from another terminal stopped the running job (its nodes exited 143, its stop record is there): "
          "what the user asked for, said so, never undone by a restart",
          (), AttemptResult(KILLED, None, 8), None, resilience(),
          Decision(Next.GIVE_UP, "job 'j' was stopped with 'kill' while it ran; nothing runs, no restart follows")),
    Story("Ctrl-C stopped the job: never undone by a restart",
          (), AttemptResult(INTERRUPTED, None, 8), None, resilience(),
          Decision(Next.GIVE_UP, "job 'j' failed: interrupted (Ctrl-C); the job was stopped on all nodes")),
]


@pytest.mark.parametrize("story", STORIES, ids=[s.story for s in STORIES])
def test_what_follows_a_failed_attempt(story: Story) -> None:
    assert decide("j", story.history, story.ended, story.reachable, story.resilience) == story.expected


def test_restart_backoff_sets_the_first_wait_and_each_further_one_doubles_it_up_to_6x() -> None:
    """--restart-backoff (default 10 s: 10, 20, 40, 60, 60 s); before it, every restart waited 10 s at least."""
    waits = [decide("j", (AttemptResult(EXITED, None, 8),) * n, AttemptResult(EXITED, None, 8 + n), None,
                    resilience(8, restart_backoff=backoff)).backoff_s
             for backoff in (10.0, 0.5) for n in (0, 1, 2, 3, 4)]
    assert waits == [10.0, 20.0, 40.0, 60.0, 60.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    first = decide("j", (), AttemptResult(EXITED, None, 8), None, resilience(restart_backoff=0.5))
    assert first.why.startswith("restart 1 of 2 in 0.5 s, from the newest valid checkpoint")


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 3601.0])
def test_a_restart_backoff_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"^--restart-backoff .* must be between 0 and 3600 seconds$"):
        resilience(restart_backoff=bad)


def test_what_is_restarted_and_what_counts_as_progress() -> None:
    assert RESTARTABLE == {End.EXITED, End.UNREACHABLE, End.STALLED, End.HOST}
    assert AttemptResult(EXITED, resumed_from=None, newest_step=8).progressed
    assert not AttemptResult(EXITED, resumed_from=8, newest_step=8).progressed
    assert not AttemptResult(EXITED, resumed_from=None, newest_step=None).progressed


def test_the_backoff_raises_a_give_up_and_ends_at_a_kills_stop_record(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill's stop record on real hosts: tests/cluster/test_self_healing.py."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    console = Console(file=io.StringIO(), width=200)
    ssh, scheduler = SSHOptions(None, None, False), DockerSSH()
    with pytest.raises(JobError, match="^why$"):
        restart.back_off(Decision(Next.GIVE_UP, "why"), "j", scheduler, ssh, [], console)
    restart.back_off(Decision(Next.RESTART, "restart 1 of 2 in 0 s", 0.2), "j", scheduler, ssh, [], console)
    assert console.file.getvalue() == "restart 1 of 2 in 0 s\n"  # type: ignore[attr-defined]
    monkeypatch.setattr(scheduler, "stop_record_seen", lambda nodes, job: job == "j")
    with pytest.raises(JobError, match="stopped with 'kill' during the restart backoff"):
        restart.back_off(Decision(Next.RESTART, "restart 1 of 2 in 10 s", 10.0), "j", scheduler, ssh, [], console)
