"""The pure parts of self-healing: heartbeat parsing and progress line, the stall rule, whom a stall blames,
when a failure is restarted."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from orchestrate.backends.docker_ssh.rfc3339 import docker_time
from orchestrate.probe.heartbeat import Beat
from orchestrate.watch.health import RankStack, StallClock, culprits, flight_recorder_lines, last_collective
from orchestrate.watch.outcome import diverged_line
from trainer.contract import PEER_WAIT_FUNCTION

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


# The end of a diverged node's log as torchrun left it (tests/trainer/test_trainer_divergence.py makes it for real).
DIVERGED_LOG = """04:36:09 [rank 0] INFO epoch 1 step 8 loss nan lr 853553390593.27368
error: training diverged at step 8: loss nan, lr 8.53553e+11; no checkpoint of it was written, the newest one is \
from before; lower --lr (or lengthen --warmup-epochs), then --resume
W1124 04:36:09.427000 6382 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 6395 closing signal SIGTERM
E1124 04:36:09.431000 6382 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 0
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : 3 (pid: 6394)
"""


def test_a_diverged_node_is_told_apart_by_the_trainers_line() -> None:
    """torchrun exits 1 whatever its workers' codes, so the cause comes from the trainer's own line."""
    assert diverged_line(DIVERGED_LOG) == (
        "training diverged at step 8: loss nan, lr 8.53553e+11; no checkpoint of it was written, the newest one is "
        "from before; lower --lr (or lengthen --warmup-epochs), then --resume")
    assert diverged_line("error: lost contact with another rank\nChildFailedError") is None


def test_docker_times_read_as_epoch_seconds() -> None:
    assert docker_time("2026-11-23T19:25:09.730402262Z") == pytest.approx(1795461909.730402)
    assert docker_time("2026-11-23T19:25:09Z") == 1795461909.0
    assert docker_time("0001-01-01T00:00:00Z") is None and docker_time("") is None and docker_time("soon") is None


def test_only_the_trainers_peer_wait_counts_as_waiting() -> None:
    """With NCCL a rank blocked on a lost peer shows no torch.distributed frame, only the trainer's read of the
    agreement (tests/trainer/test_trainer_host_syncs.py makes a real dump there); the rest of trainer/dist.py is
    not a wait."""
    wait = f'File "/app/trainer/dist.py", line 120 in {PEER_WAIT_FUNCTION}\n  File "/app/trainer/loop.py", line 9 in run\n'
    picking = 'File "/app/trainer/dist.py", line 70 in _pick_device\n  File "/app/trainer/__main__.py", line 5 in main\n'
    assert RankStack(0, 0, wait).in_collective and not RankStack(1, 1, picking).in_collective
    assert culprits([RankStack(0, 0, wait), RankStack(1, 1, picking)]) == [1]


def test_the_node_outside_the_collective_is_blamed() -> None:
    waiting = "File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 2 in all_reduce"
    stacks = [RankStack(0, 0, waiting), RankStack(0, 1, waiting), RankStack(1, 2, ""), RankStack(1, 3, waiting)]
    assert culprits(stacks) == [1]  # rank 2 wrote nothing: stopped
    busy = [RankStack(0, 0, waiting), RankStack(1, 1, 'File "/app/train.py", line 9 in spin')]
    assert culprits(busy) == [1]
    assert culprits([RankStack(0, 0, waiting), RankStack(1, 1, waiting)]) == []  # all wait: nobody to blame
    assert culprits([RankStack(0, 0, ""), RankStack(1, 1, "")]) == []  # nothing to compare with


def _real_dump(tmp_path: Path, collectives: int) -> bytes:
    """A flight-recorder dump as torch writes it (its pickle format; gloo has the recorder too on this torch)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{collectives}'}", rank=0, world_size=1)
    try:
        for _ in range(collectives):
            dist.all_reduce(torch.ones(2))
        return bytes(_dump_fr_trace())
    finally:
        dist.destroy_process_group()


def test_flight_recorder_dumps_name_the_rank_that_never_reached_the_collective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read without torch (plain data only); a rank whose newest collective is older than the others' is behind."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    behind = _real_dump(tmp_path, 2)  # first: the recorder is one per process and keeps older groups' entries
    ahead = _real_dump(tmp_path, 3)
    assert last_collective(ahead) == (3, "gloo:all_reduce scheduled")
    lines = flight_recorder_lines({0: ahead, 1: behind, 2: b"not a pickle"})
    assert lines == ["flight recorder of rank 0: last collective #3 gloo:all_reduce scheduled",
                     "flight recorder of rank 1: last collective #2 gloo:all_reduce scheduled",
                     "flight recorder of rank 2: unreadable dump",
                     "flight recorder: rank(s) 1 never reached collective #3"]
    assert flight_recorder_lines({}) == ["flight recorder: no dump (torch writes them only when NCCL's watchdog "
                                         "times out)"]


def test_a_dump_that_would_load_code_is_refused() -> None:
    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, ("true",))

    assert last_collective(pickle.dumps({"entries": [Payload()]})) is None
