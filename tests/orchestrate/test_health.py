"""The pure parts of self-healing: heartbeat parsing and progress line, the stall rule, whom a stall blames,
when a failure is restarted."""

from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from orchestrate import pipeline as up
from orchestrate import state
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import JobError
from orchestrate.health import Beat, RankStack, StallClock, culprits
from orchestrate.launch import End, Outcome, docker_time
from orchestrate.pipeline import Attempt

BEAT = {"state": "training", "step": 120, "epoch": 3, "ckpt_step": 80, "loss": 1.23456, "images_per_s": 412.4,
        "eta_s": 312.0, "total_steps": 600, "epochs": 15, "slowest_step_s": 0.5, "time": 1.0}


def beat(**changes: object) -> Beat:
    parsed = Beat.parse(json.dumps({**BEAT, **changes}))
    assert parsed is not None
    return parsed


def test_progress_line_says_step_of_total_epoch_speed_and_eta() -> None:
    assert beat().progress_line() == "step 120/600 (20%) epoch 3/15 loss 1.235 412 img/s ETA 0h05m12s"
    assert beat(state="evaluating").progress_line().endswith(" evaluating")
    # Another program's heartbeat may hold only a step.
    minimal = Beat.parse('{"step": 7}')
    assert minimal is not None and minimal.progress_line() == "step 7"


def test_a_torn_or_foreign_heartbeat_is_no_heartbeat() -> None:
    assert Beat.parse('{"step": 1') is None and Beat.parse("[]") is None and Beat.parse('{"epoch": 1}') is None


def test_stall_needs_a_change_first_then_the_timeout_and_3x_the_slowest_step() -> None:
    clock = StallClock(timeout_s=30, last_change=0.0)
    clock.update(beat(), now=0.0)  # a file from an earlier run: no evidence of this one
    assert clock.stalled_for(1000.0) is None
    clock.update(beat(step=121), now=10.0)
    assert clock.stalled_for(39.0) is None and clock.stalled_for(41.0) == 31.0
    clock.update(beat(step=122, slowest_step_s=20.0), now=50.0)  # slow steps: 3 x 20 s
    assert clock.limit_s() == 60.0 and clock.stalled_for(105.0) is None and clock.stalled_for(111.0) == 61.0
    clock.update(beat(step=122, slowest_step_s=20.0), now=200.0)  # the same content: no progress
    assert clock.stalled_for(200.0) == 150.0
    assert StallClock(timeout_s=0).stalled_for(1e9) is None  # off


def test_a_beat_written_after_node_0s_container_started_arms_the_stall_check_at_its_first_read() -> None:
    # The run stops before the orchestrator has read two different beats (a fast job, a stop right at the
    # start): the one beat it reads is this run's by its time, and the stall is found.
    clock = StallClock(timeout_s=30, last_change=0.0, started_at=100.0)
    clock.update(beat(time=105.0), now=3.0)
    assert clock.stalled_for(34.0) == 31.0
    stale = StallClock(timeout_s=30, last_change=0.0, started_at=100.0)
    stale.update(beat(time=99.0), now=3.0)  # written before this run's container started: an earlier run's
    assert stale.stalled_for(1000.0) is None
    unknown = StallClock(timeout_s=30, last_change=0.0)
    unknown.update(beat(time=105.0), now=3.0)  # node 0's start not known yet (its poll did not answer)
    assert unknown.stalled_for(1000.0) is None
    unknown.started_at = 100.0
    assert unknown.stalled_for(1000.0) == 997.0
    foreign = StallClock(timeout_s=30, last_change=0.0, started_at=100.0)
    foreign.update(Beat.parse('{"step": 7}'), now=3.0)  # no time: only a change arms it
    assert foreign.stalled_for(1000.0) is None


def test_docker_times_read_as_epoch_seconds() -> None:
    assert docker_time("2026-11-23T19:25:09.730402262Z") == pytest.approx(1795461909.730402)
    assert docker_time("2026-11-23T19:25:09Z") == 1795461909.0
    assert docker_time("0001-01-01T00:00:00Z") is None and docker_time("") is None and docker_time("soon") is None


def test_the_node_outside_the_collective_is_blamed() -> None:
    waiting = "File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 2 in all_reduce"
    stacks = [RankStack(0, 0, waiting), RankStack(0, 1, waiting), RankStack(1, 2, ""), RankStack(1, 3, waiting)]
    assert culprits(stacks) == [1]  # rank 2 wrote nothing: stopped
    busy = [RankStack(0, 0, waiting), RankStack(1, 1, 'File "/app/train.py", line 9 in spin')]
    assert culprits(busy) == [1]
    assert culprits([RankStack(0, 0, waiting), RankStack(1, 1, waiting)]) == []  # all wait: nobody to blame
    assert culprits([RankStack(0, 0, ""), RankStack(1, 1, "")]) == []  # nothing to compare with


def test_what_is_restarted() -> None:
    assert {e for e in End if e.restartable} == {End.EXITED, End.UNREACHABLE, End.STALLED, End.HOST}
    failed = Outcome(False, End.EXITED, 1, "exited with code 1", host="b")
    assert failed.cause == "node 1 (b) exited with code 1"
    assert Attempt(failed, resumed_from=None, newest_step=8).progressed
    assert not Attempt(failed, resumed_from=8, newest_step=8).progressed
    assert not Attempt(failed, resumed_from=None, newest_step=None).progressed


def test_restart_or_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(up, "BACKOFF_S", 0.2)
    cfg = UpConfig(ssh=SSHOptions(None, None, False), job="j", max_restarts=2)
    console = Console(file=io.StringIO(), width=200)
    failed = Outcome(False, End.EXITED, 1, "exited with code 1", host="b")
    began = time.time()
    up._restart_or_raise(cfg, cfg, Attempt(failed, None, 8), None, began, console)  # restarted, after a backoff
    assert "restart 1 of 2 in 0 s" in console.file.getvalue()  # type: ignore[attr-defined]
    with pytest.raises(JobError, match=r"node 0 removed; the job was stopped on all nodes$"):
        up._restart_or_raise(cfg, cfg, Attempt(Outcome(False, End.REMOVED, 0, "removed"), None, 8), None, began,
                             console)
    second = dataclasses.replace(cfg, restart=1)
    with pytest.raises(JobError, match="same failure repeated before any new checkpoint"):
        up._restart_or_raise(cfg, second, Attempt(failed, 8, 8), Attempt(failed, None, 8), began, console)
    never = Attempt(failed, None, None)  # twice before the first checkpoint: the second started over
    with pytest.raises(JobError, match=r"before any new checkpoint was written: not restarting again"):
        up._restart_or_raise(cfg, second, never, never, began, console)
    # The same kind on another node (a crash takes its peers down; which exit is seen first varies): a repeat.
    elsewhere = Outcome(False, End.EXITED, 0, "exited with code 1", host="a")
    with pytest.raises(JobError, match="same failure repeated"):
        up._restart_or_raise(cfg, second, Attempt(elsewhere, 8, 8), Attempt(failed, None, 8), began, console)
    # Another kind of failure without progress, or the same after progress: restarted.
    other = Outcome(False, End.UNREACHABLE, 0, "host unreachable for 15 s", host="a")
    up._restart_or_raise(cfg, second, Attempt(other, 8, 8), Attempt(failed, None, 8), began, console)
    up._restart_or_raise(cfg, second, Attempt(failed, 8, 16), Attempt(failed, None, 8), began, console)
    with pytest.raises(JobError, match=r"after 2 automatic restart\(s\)"):
        up._restart_or_raise(cfg, dataclasses.replace(cfg, restart=2), Attempt(failed, 16, 24), None, began, console)
    state.mark_killed("j")
    with pytest.raises(JobError, match="stopped with 'kill' during the restart backoff"):
        up._restart_or_raise(cfg, cfg, Attempt(failed, None, 8), None, began, console)
