"""Self-healing jobs on real test hosts (CPU image): automatic restarts after a killed container, a stalled
rank and a host cut off for good; a repeated crash and a `kill` during the backoff end it all.

With the test data (256 images) and --batch-size 16, one process per node: 8 steps per epoch on 2 nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.orchestrate_kit import (
    PATIENCE,
    Data,
    Up,
    crash_image,
    default_dirs,
    epochs_of,
    job_containers,
    job_dir,
    manifests,
    metrics,
    node_container,
    orchestrate,
    serve_data,
    start,
    throttle_job,
    up_args,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


def beat(cluster: Cluster, node: int, job: str) -> dict | None:
    try:
        return json.loads((job_dir(cluster, node, job) / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return None


def test_a_killed_container_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """--restart-backoff 1: the default 10 s only waited (its length is tests/orchestrate/test_restarts.py's, a kill during it test_kill_during_the_backoff_...'s)."""
    job, state = "heal-kill", work / "state-kill"
    up = Up(start(target, state, *up_args(hosts, data, job, "--max-restarts", "2", "--restart-backoff", "1",
                                          trainer=("--epochs", "20"))))
    ckpt, beats = job_dir(target, 0, job), []

    def progressing() -> bool:
        seen = beat(target, 0, job)
        if seen and seen.get("state") == "training" and "eta_s" in seen and \
                (not beats or seen["step"] > beats[-1]["step"]):
            beats.append(seen)
        return len(manifests(ckpt)) >= 3 and len(beats) >= 2 and beats[-1]["step"] >= 40  # a quarter of the run

    wait_for(progressing, PATIENCE, "a quarter of the run, with heartbeats", every=0.5)
    at_kill = beat(target, 0, job)
    node_container(target, job, 1).kill()  # SIGKILL
    killed = time.monotonic()
    assert up.wait(600) == 0
    assert "restart 1 of 2 in" in up.text and "cause: node 1 (" in up.text and "exited with code 137" in up.text
    assert "finished: epochs=20 step=160 " in up.text
    records = metrics(target, 0, job)
    restarts = [r for r in records if r.get("event") == "restart"]
    assert len(restarts) == 1 and restarts[0]["restart"] == 1 and "node 1" in restarts[0]["cause"]
    detected, training = up.first("failed: exited", killed), up.first("[rank 0] INFO epoch", up.first("--- restart"))
    lost = (at_kill or {}).get("step", 0) - restarts[0]["step"]
    print(f"killed container: detected after {detected - killed:.1f} s, training again after "
          f"{training - killed:.1f} s (1 s of it the backoff: --restart-backoff 1), about {lost} step(s) trained again")
    assert epochs_of(records) == list(range(1, 21))  # continuous: what was trained again is recorded once
    # Progress: the heartbeat advanced, each beat with an ETA for the steps left, and it ends at the totals. The
    # ETA follows this shared machine's pace, so it may rise between two beats (CI: 16.8 s at step 8, 17.5 s at
    # step 80); that it falls at a steady pace is a trainer test.
    assert beats[-1]["step"] > beats[0]["step"] and all(b["eta_s"] > 0 for b in beats)
    final = beat(target, 0, job)
    assert final is not None and final["state"] == "done" and final["step"] == final["total_steps"] == 160
    assert "progress: step 160/160 (100%) epoch 20/20" in up.text
    # Each new checkpoint was copied to node 1 and verified there, the final one too (written after the last poll).
    assert "copied to node 1 (" in up.text and manifests(job_dir(target, 1, job))[-1]["step"] == 160
    assert "checkpoint step 160 copied to node 1 (" in up.text


def test_a_crash_that_repeats_without_progress_is_not_restarted_again(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """--restart-backoff 1: the default 10 s only waited (its length is tests/orchestrate/test_restarts.py's, a kill during it test_kill_during_the_backoff_...'s)."""
    job, state = "heal-crash", work / "state-crash"
    res = orchestrate(target, state, *up_args(hosts, data, job, "--max-restarts", "3", "--restart-backoff", "1",
                                              "--env", "CRASH_AT_STEP=20", trainer=("--epochs", "5"),
                                              image=crash_image()),
                      timeout=600)
    assert res.returncode == 1
    assert "same failure repeated before any new checkpoint was written (step 16)" in res.stderr
    assert res.stdout.count("restart 1 of 3 in") == 1 and "restart 2 of 3" not in res.stdout
    assert [r["restart"] for r in metrics(target, 0, job) if r.get("event") == "restart"] == [1]
    assert job_containers(target, job) == []


def test_a_diverging_run_is_named_and_not_restarted_into_the_same_divergence(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """A huge --lr: every rank stops at the same agreement with exit 3 (torchrun's own code is 1), the cause
    says the training diverged, and the restart (from the beginning: nothing was saved before step 8)
    diverges again before any checkpoint: the same-failure rule stops it. No checkpoint exists on any node.
    --restart-backoff 1: the default 10 s only waited."""
    job, state = "heal-diverge", work / "state-diverge"
    res = orchestrate(target, state, *up_args(hosts, data, job, "--max-restarts", "3", "--restart-backoff", "1",
                                              trainer=("--epochs", "5", "--lr", "1e12", "--warmup-epochs", "0")),
                      timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "training diverged at step " in res.stderr and ": loss nan, lr " in res.stderr and "lower --lr" in res.stderr
    assert "same failure repeated before any new checkpoint was written" in res.stderr
    assert res.stdout.count("restart 1 of 3 in") == 1 and "restart 2 of 3" not in res.stdout
    assert not any(manifests(job_dir(target, n, job)) for n in range(len(target.hosts)))
    assert job_containers(target, job) == []


def test_kill_during_the_backoff_stops_everything_and_nothing_restarts(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    job, state = "heal-backoff", work / "state-backoff"
    up = Up(start(target, state, *up_args(hosts, data, job, "--max-restarts", "2", trainer=("--epochs", "200"))))
    wait_for(lambda: len(manifests(job_dir(target, 0, job))) >= 1, PATIENCE, "a first checkpoint")
    node_container(target, job, 1).kill()
    up.wait_for_line("restart 1 of 2 in", PATIENCE, "the restart backoff")
    killed = orchestrate(target, state, "kill", "--job", job)
    assert killed.returncode == 0
    assert up.wait(PATIENCE) == 1
    assert "--- restart 1" not in up.text and job_containers(target, job) == []


def test_kill_from_another_machine_during_the_backoff_stops_everything(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """The kill runs with another local state dir (another XDG_STATE_HOME: another laptop of the same login), so it
    shares nothing with `up` but the hosts: its stop record there ends the backoff."""
    job = "heal-elsewhere"
    up = Up(start(target, work / "state-here", *up_args(hosts, data, job, "--max-restarts", "2", "--env",
                                                         "CRASH_AT_STEP=2", trainer=("--epochs", "5"),
                                                         image=crash_image())))
    up.wait_for_line("restart 1 of 2 in", 420, "the restart backoff")  # the first start; slow on a loaded machine
    killed = orchestrate(target, work / "state-elsewhere", "kill", "--job", job, "--hosts", str(hosts))
    assert killed.returncode == 0
    assert up.wait(120) == 1
    assert f"job {job!r} was stopped with 'kill' during the restart backoff" in up.text
    assert "--- restart 1" not in up.text and job_containers(target, job) == []
    assert "left a stop record on 2 host(s)" in killed.stdout


LAUNCHERS = ("torchrun", "distributed.run", "trainer.launch")


def rank_1_worker(cluster: Cluster, job: str) -> int:
    """The host PID of node 1's training process (not its launcher: torchrun's agent or trainer.launch), once it runs."""
    def find() -> list[int]:
        try:
            victim = node_container(cluster, job, 1)
        except AssertionError:  # not created yet
            return []
        if victim.status == "created":  # `up` creates every node's container, then starts them: `top` answers 409
            return []
        return [int(p[1]) for p in victim.top(ps_args="-o user,pid,args")["Processes"]
                if " -m trainer" in p[2] and not any(launcher in p[2] for launcher in LAUNCHERS)]

    wait_for(lambda: len(find()) == 1, PATIENCE, "node 1's training process", every=0.1)
    return find()[0]


def test_a_rank_stopped_as_training_starts_is_found_as_a_stall_and_the_job_starts_over(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """Rank 1 stops right after rank 0's first beat: rank 0 then waits in its first step, the beat never
    changes, and `up` reads one beat only. It is this run's by its time, so the stall is still found (a check
    armed only by a change saw nothing until --dist-timeout); with no checkpoint yet, training starts over.
    --restart-backoff 1: the default 10 s only waited."""
    job, state = "heal-stall", work / "state-stall"
    # One checkpoint, at the end: 8 s after the first beat here, where one every epoch comes after 0.6 s, so a
    # test process scheduled late on a busy machine still stops rank 1 before any checkpoint.
    up = Up(start(target, state, *up_args(hosts, data, job, "--max-restarts", "1", "--restart-backoff", "1", "--stall-timeout", "15",
                                          trainer=("--epochs", "20", "--ckpt-every", "20"))))
    worker = rank_1_worker(target, job)
    heartbeat = job_dir(target, 0, job) / "heartbeat.json"
    wait_for(heartbeat.exists, PATIENCE, "rank 0's first heartbeat", every=0.02)
    os.kill(worker, signal.SIGSTOP)
    stopped_at, at_stop = time.monotonic(), beat(target, 0, job)
    assert not manifests(job_dir(target, 0, job)), "a checkpoint came before the stop: not the run's start"
    # The limit is max(--stall-timeout, 3x the slowest step), and no step has ended: 15 s, then a poll or two.
    up.wait_for_line("job stalled", 15 + 60, f"the stall to be found (heartbeat at the stop: {at_stop})")
    detected_s = time.monotonic() - stopped_at
    assert up.wait(600) == 0, up.text[-4000:]
    training = up.first("[rank 0] INFO epoch", up.first("--- restart"))
    print(f"stalled rank: training again {training - stopped_at:.1f} s after the SIGSTOP")
    assert f"rank 1 on node 1 ({target.hosts[1].name}): NO DUMP" in up.text
    assert f"rank 0 on node 0 ({target.hosts[0].name}): waiting in a collective" in up.text
    assert "stalled by node 1 (" in up.text and "--- restart 1 of 1 ---" in up.text
    assert "restart 1: no checkpoint was written before the failure; training starts again from the beginning" \
        in up.text
    assert "finished: epochs=20 step=160 " in up.text
    records = metrics(target, 0, job)
    assert records[0]["event"] == "restart" and records[0]["step"] == 0 and "stalled by node 1" in records[0]["cause"]
    assert epochs_of(records) == list(range(1, 21))
    saved = sorted(job_dir(target, 0, job, "logs").glob("stall-*.txt"))
    assert len(saved) == 1 and f"stack dumps saved in {target.hosts[0].name}:" in up.text
    report = saved[0].read_text()
    # Rank 0's dump holds the thread that took the signal ("Current thread") among its others (TensorBoard's writer's
    # is newer, and faulthandler lists the newest first).
    rank_0 = report.split("==== rank 0 on node 0\n", 1)[1].split("\n==== rank ", 1)[0]
    assert "stalled by node 1" in report and "Current thread" in rank_0, report[-3000:]
    print(f"stall detected {detected_s:.1f} s after SIGSTOP (--stall-timeout 15; heartbeat then: {at_stop})")


def corrupt_newest(folder: Path) -> tuple[int, str]:
    """Flip one byte (same size) of the newest checkpoint in `folder`: of its .pt (DDP) or of one shard file of its
    step folder (FSDP). The step of the one before it, and the corrupted one's manifest path within `folder`."""
    newest, before = sorted(manifests(folder), key=lambda m: int(m["step"]))[-1:-3:-1]  # type: ignore[call-overload]
    if "file" in newest:
        target, name = folder / str(newest["file"]), str(newest["file"]).removesuffix(".pt") + ".json"
    else:
        (step_dir,) = [p.parent for p in folder.glob("ckpt-*/manifest.json")
                       if json.loads(p.read_text())["step"] == newest["step"]]
        target, name = step_dir / sorted(newest["files"])[0], f"{step_dir.name}/manifest.json"  # type: ignore[call-overload]
    with target.open("r+b") as fh:
        fh.seek(target.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return int(before["step"]), name  # type: ignore[call-overload]


def sshd_answers(addr: str) -> bool:
    """Whether a TCP connection to the host's sshd opens (a bounded try)."""
    try:
        with socket.create_connection((addr, 22), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def three(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """The session's three hosts (as the network check and the stock-hosts test use them, one without SFTP):
    node 0's host is cut off for the rest of the job, then its link comes back and the job is killed."""
    c = cluster_factory(3, no_sftp=[2])
    yield c
    c.hosts[0].link_up()


def test_node_0s_host_cut_off_the_job_finishes_on_the_others_from_the_replica(three: Cluster, work: Path) -> None:
    """One cut covers what it alone shows, with FSDP (the harder checkpoint): the checkpoint is a folder of 3 ranks'
    shards, gathered on node 0 and replicated to node 1; after the cut the newest replica is corrupted, named and
    passed over for the one before it, which 2 ranks load resharded. What a DDP cut would add is proven
    elsewhere: a .pt replicated and verified on node 1 (test_a_killed_container_is_restarted...), a corrupted .pt
    replica passed over by the real size and sha256 check (tests/orchestrate/test_resume_search.py), a DDP
    resume on another world size (tests/trainer/test_trainer_distributed.py). --restart-backoff 1: the default 10 s
    only waited. The resume checkpoint reaches the third host from the second inside the cluster (--relay on), not
    through this machine. The first attempt runs at a tenth of a core per container (docker update), so that the cut lands
    mid-run on a machine of any speed; the restart's containers are new and unthrottled."""
    job, state = "heal-cut", work / "state-cut"
    # Data of its own: the stock-hosts test on these hosts sends its archive into the default data dir.
    hosts = three.write_hosts_file(work / "hosts3.txt", keys={h.index: {"data_dir": f"{h.home}/heal-cut-data"}
                                                              for h in three.hosts})
    with serve_data(work / "served3", three.gateway) as data3:
        up = Up(start(three, state, *up_args(hosts, data3, job, "--max-restarts", "1", "--restart-backoff", "1",
                                             "--min-nodes", "2", "--relay", "on",
                                             trainer=("--epochs", "20", "--strategy", "fsdp"))))
        replica = job_dir(three, 1, job)
        # The first attempt's containers get a tenth of a core each (the job's 100 steps took ~6 s on one thread
        # each, ending before two replicas were copied and verified; at a quarter of a core, a CI run whose copies
        # were slow still saw it finish first): the cut lands while it trains.
        wait_for(lambda: len([c for _, c in job_containers(three, job) if c.status == "running"]) == 3, PATIENCE,
                 "the job's 3 containers to run", every=0.2)
        assert throttle_job(three, job, cpus=0.1) == 3
        # two replicas copied and verified (not merely their manifests there): one to corrupt, one to resume from
        wait_for(lambda: len(re.findall(r"^checkpoint step \d+ copied to node 1 \(.*sha256 verified$", up.text, re.M))
                 >= 2, PATIENCE, "two verified replicas of checkpoints on node 1", every=0.5)
        assert "finished: epochs=" not in up.text, "the job ended before the cut: slow it more"
        three.hosts[0].link_down()
        cut = time.monotonic()
        replicated, bad = corrupt_newest(replica)
        assert up.wait(PATIENCE) == 0, up.text[-4000:]
    detected, training = up.first("failed: host unreachable", cut), up.first("[rank 0] INFO epoch",
                                                                             up.first("--- restart"))
    print(f"host cut off: detected after {detected - cut:.1f} s, training again on 2 nodes after "
          f"{training - cut:.1f} s")
    assert f"leaving out {three.hosts[0].name}: " in up.text
    # The corrupted newest replica is named and passed over for the one before it.
    assert (f"warning: {three.hosts[1].name}:{default_dirs(three, 1, job)['ckpt']}/{bad}: the checkpoint does "
            "not match its manifest") in up.text
    resumed = up.text.split("resuming from", 1)[1].splitlines()[0]
    assert re.search(rf"\bstep {replicated}\b", resumed), resumed
    assert three.hosts[1].name in resumed or three.hosts[1].addr in resumed
    # The folder went from node 1's host to node 2's inside the cluster (--relay on: auto relays from 3 nodes in all),
    # not through here; node 2 had none of it (replicas go to node 1 only).
    assert re.findall(r"^checkpoint step (\d+) on (.*): fetched from the relay on (.*), sha256 verified, 0 bytes "
                      r"through here$", up.text, re.M) == [(str(replicated), three.hosts[2].name, three.hosts[1].name)]
    assert "copying it through here" not in up.text
    # Nothing left behind: no archive in the relay folders (the server's, the fetch's), no staging folder beside it.
    assert [p for h in three.hosts[1:] for p in h.path(f"{h.home}/.cache/ddp-cifar/relay").glob("*")] == []
    assert list(job_dir(three, 2, job).glob(".ddp-relay.*")) == []
    # 256 images, global batch 3 x 16 = 48: 5 steps per epoch, kept on 2 nodes (24 per process).
    records = metrics(three, 1, job)
    restart = [r for r in records if r.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["world_size"] == 2 and restart[0]["global_batch"] == 48
    assert restart[0]["step"] >= replicated
    assert epochs_of(records) == list(range(1, 21)) and {r["global_batch"] for r in records} == {48}
    assert "finished: epochs=20 step=100 " in up.text
    assert "/ckpt-" in resumed and ".pt" not in resumed and "saved by 3 processes" in up.text
    assert [m["world_size"] for m in manifests(replica)][-1] == 2
    # Node 0's link comes back: the containers left there by the cut are removed by `kill`.
    three.hosts[0].link_up()
    # Until the host answers again: right after the link comes back its address may still be unresolved on the
    # bridge (no route for a few seconds), and a kill then rightly says it cannot reach it (seen in CI).
    wait_for(lambda: sshd_answers(three.hosts[0].addr), 60, "node 0's host to answer again", every=0.2)
    cleaned = orchestrate(three, state, "kill", "--job", job, "--grace", "5")
    assert cleaned.returncode == 0 and job_containers(three, job) == []
