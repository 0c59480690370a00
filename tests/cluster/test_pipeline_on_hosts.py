"""`up -- --pp 2` on the session's two stock test hosts (sshd + dockerd + torchrun, CPU image): one process per
host, so stage 0 runs on node 0 and stage 1 on node 1 and only activations cross between them.

One job does it all (a job's start is what a cluster test costs): it trains until rank 0's heartbeat carries every
rank's stage (the second agreement window: the per-rank view's figures lag one), `kill` stops it (every rank saves
its shards on SIGTERM, at the step it stopped at), and `up --resume` continues from exactly that step, as a
pipeline again, to the end of its epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kit.orchestrate_kit import (
    PATIENCE,
    Data,
    job_dir,
    manifests,
    orchestrate,
    sigterm_step,
    up_args,
    wait_for,
)

from devcluster import Cluster
from trainer.contract import HEARTBEAT_FILE, Beat

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

JOB = "piped"
# The cheapest model --pp accepts (GroupNorm; 9 blocks); uniform: no block timing at start (auto is tested in
# tests/trainer/test_trainer_pipeline.py); 2 micro-batches, the fewest 1F1B takes. 4 images a process: on SIGTERM
# the ranks run on to their next agreement (up to 8 steps) before they save, and torchrun SIGKILLs its workers 30 s
# after its own SIGTERM: at 16 a process this loaded machine (load average 15) ran 5 s a step, and the stop's
# checkpoint was never written. 256 images at 2 x 4 a step: 32 steps an epoch.
PIPELINE = ("--model", "resnet20-gn", "--pp", "2", "--pp-split", "uniform", "--pp-microbatches", "2",
            "--batch-size", "4")


def _beat(cluster: Cluster) -> Beat | None:
    path = job_dir(cluster, 0, JOB) / HEARTBEAT_FILE
    return Beat.parse(path.read_text()) if path.is_file() else None


def _log_tails(cluster: Cluster) -> str:
    """Every rank's last log lines on every node: what a failed stop or resume said."""
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                     for node in range(len(cluster.hosts))
                     for log in sorted(job_dir(cluster, node, JOB, "logs").rglob("*.log")))


def test_pp2_on_two_hosts_trains_stops_on_kill_and_resumes_from_the_stop_step(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state = work / "state"
    started = orchestrate(target, state, *up_args(hosts, data, JOB, "--detach", trainer=(*PIPELINE, "--epochs", "40")))
    assert started.returncode == 0
    ckpt = job_dir(target, 0, JOB)
    try:
        # Rank 0's heartbeat says which stage each rank holds: stage 0 on node 0, stage 1 on node 1.
        wait_for(lambda: (beat := _beat(target)) is not None and beat.rank_stage is not None, PATIENCE,
                 "a heartbeat with every rank's stage")
        beat = _beat(target)
        assert beat is not None and beat.rank_stage == (0, 1) and beat.ranks_per_node == 1, beat
    finally:
        killed = orchestrate(target, state, "kill", "--job", JOB, "--grace", "30")
    assert killed.returncode == 0
    stopped = sigterm_step(target, 0, JOB)
    newest = max(manifests(ckpt), key=lambda m: int(str(m["step"])))
    assert stopped is not None and newest["step"] == stopped, (stopped, newest, _log_tails(target))

    target_epochs = int(str(newest["epoch"])) + 1
    resumed = orchestrate(target, state, *up_args(hosts, data, JOB, "--resume",
                                                  trainer=(*PIPELINE, "--epochs", str(target_epochs))))
    assert resumed.returncode == 0, _log_tails(target)
    assert f"ckpt-{stopped:08d}" in resumed.stdout.split("resuming from", 1)[1].splitlines()[0]
    assert "pipeline: 2 stages x 1 replicas" in resumed.stdout
    assert f"finished: epochs={target_epochs}" in resumed.stdout
    steps = [json.loads(ln) for ln in (ckpt / "metrics.jsonl").read_text().splitlines()]
    after = [r["step"] for r in steps if r.get("kind") == "train_step" and r["step"] > stopped]
    assert after and min(after) <= stopped + 4, after  # it went on from the stop step (a record every 4 steps)
