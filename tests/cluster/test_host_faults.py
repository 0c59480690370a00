"""Faults of a whole host under a running job, on real test hosts (CPU image): its Docker daemon restarts, then
the host reboots (devcluster's reboot: every process ends, a new boot id, the daemons start again). `up` names
each with its own cause and, with --max-restarts, continues from the newest checkpoint on all nodes.

With the test data (256 images) and --batch-size 16, one process per node: 8 steps per epoch on 2 nodes.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from kit.orchestrate_kit import (
    PATIENCE,
    Data,
    Up,
    epochs_of,
    example_image,
    job_containers,
    job_dir,
    manifests,
    metrics,
    orchestrate,
    start,
    up_args,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

CHARLM_ARGS = ["--steps", "3", "--step-seconds", "0", "--ckpt-every", "1000", "--text", "input.txt", "--context", "4"]


def newest_manifest_step(cluster: Cluster, node: int, job: str) -> int:
    return max((int(m["step"]) for m in manifests(job_dir(cluster, node, job))), default=-1)  # type: ignore[call-overload]


def test_a_daemon_restart_then_a_reboot_under_the_job_are_named_and_the_job_continues(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """--restart-backoff 1 (1 s, then 2 s): the default's 10 and 20 s only waited; the backoff's own length and
    doubling are tests/orchestrate/test_restarts.py's, a host down past it test_a_host_down_past_the_backoff_...'s."""
    job, state, h1 = "host-faults", work / "state-host", target.hosts[1]
    # 10 epochs of 8 steps: the reboot, after the first checkpoint that follows restart 1, lands with epochs still to
    # train (with 6, a faster step once let the job reach its last checkpoint first: nothing trained after restart 2).
    up = Up(start(target, state, *up_args(hosts, data, job, "--max-restarts", "2", "--restart-backoff", "1",
                                                 trainer=("--epochs", "10"))))
    try:
        wait_for(lambda: newest_manifest_step(target, 0, job) >= 8, 600, "a checkpoint", every=0.5)
        h1.stop_docker()  # a daemon restart (an upgrade, an admin): its containers end with it
        h1.start_docker()
        restarted = time.monotonic()
        up.wait_for_line("--- restart 1 of 2 ---", 300, "the first restart")
        resumed = newest_manifest_step(target, 0, job)
        wait_for(lambda: newest_manifest_step(target, 0, job) > resumed, 600, "a checkpoint after the restart",
                 every=0.5)
        h1.reboot()
        rebooted = time.monotonic()
        assert up.wait(PATIENCE) == 0
    finally:
        if up.proc.poll() is None:
            up.wait(1)
    # Seen at once, or (a daemon still answering while it stops) once the job is stopped: the restart's cause.
    assert f"cause: node 1 ({h1.name}) Docker daemon on {h1.name} restarted" in up.text
    assert f"cause: node 1 ({h1.name}) {h1.name} rebooted" in up.text
    assert "unreachable" not in up.text
    assert "finished: epochs=10 step=80 " in up.text
    records = metrics(target, 0, job)
    causes = [r["cause"] for r in records if r.get("event") == "restart"]
    assert len(causes) == 2 and "restarted" in causes[0] and "rebooted" in causes[1]
    assert epochs_of(records) == list(range(1, 11))
    (seen_1, again_1), (seen_2, again_2) = [
        (up.first(f"node 1 ({h1.name}) failed", at) - at, up.first("[rank 0] INFO epoch", up.first(mark, at)) - at)
        for at, mark in ((restarted, "--- restart 1"), (rebooted, "--- restart 2"))]
    print(f"daemon restart: detected after {seen_1:.1f} s, training again after {again_1:.1f} s; "
          f"reboot: detected after {seen_2:.1f} s, training again after {again_2:.1f} s (1-2 s the backoff)")
    cleaned = orchestrate(target, state, "kill", "--job", job, "--grace", "5")
    assert cleaned.returncode == 0 and job_containers(target, job) == []


def test_a_host_down_past_the_backoff_is_waited_for_and_the_restart_runs_once_it_is_back(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """A slow reboot: host 1 goes down under the job and stays down past the backoff (--restart-backoff 1: the
    default 10 s only waited; the host stays down until the wait for it is seen, whatever the backoff). The restart waits for it
    (at most 120 s: plan/restarts.py; Scheduler.await_hosts) instead of failing its preflight, and runs once the host is back.
    The failure seen first is usually node 0's exit (its gloo peer vanished), not host 1's silence: waited for too."""
    job, h1 = "host-down", target.hosts[1]
    up = Up(start(target, work / "state-down", *up_args(hosts, data, job, "--max-restarts", "1", "--restart-backoff",
                                                        "1", trainer=("--epochs", "1"))))
    down = False
    try:
        wait_for(lambda: len([c for _, c in job_containers(target, job) if c.status == "running"]) == 2, PATIENCE,
                 "the job's containers to run", every=0.5)
        h1.shut_down()
        down = True
        wait_for(lambda: f"waiting for {h1.name} to answer again" in up.text or up.proc.poll() is not None, 300,
                 "the wait for the host", every=0.2)
        assert up.proc.poll() is None, up.text[-3000:]
        h1.boot()
        down = False
        assert up.wait(PATIENCE) == 0
    finally:
        if down:
            h1.boot()
        if up.proc.poll() is None:
            up.wait(1)
    waited = up.text.split(f"waiting for {h1.name} to answer again", 1)[1]
    assert "--- restart 1 of 1 ---" in waited and "finished: epochs=1 step=8 " in waited
    cleaned = orchestrate(target, work / "state-down", "kill", "--job", job, "--grace", "5")
    assert cleaned.returncode == 0 and job_containers(target, job) == []


def test_a_data_folder_that_fills_during_extraction_fails_in_one_line_and_the_next_up_completes(
        target: Cluster, work: Path, data: Data) -> None:
    """Host 1's data folder is a 2 MB tmpfs in its own mount namespace: the 1.25 MB archive downloads, extracting
    it does not fit. Nothing partial is left or marked verified; with more room the next `up` completes."""
    job, state, h1 = "data-full", work / "state-full", target.hosts[1]
    folder = "/mnt/data-full"
    hosts = target.write_hosts_file(work / "hosts-full.txt", keys={1: {"data_dir": f"{folder}/data"}})
    uid = h1.run(["id", "-u", target.user]).stdout.strip()
    h1.run(["mkdir", "-p", folder])
    h1.run(["mount", "-t", "tmpfs", "-o", f"size=2m,uid={uid},mode=0755", "tmpfs", folder])
    try:
        full = orchestrate(target, state, *up_args(hosts, data, job, "--min-free-gb", "0", trainer=("--epochs", "1")),
                           timeout=600)
        assert full.returncode != 0
        line = next(ln for ln in full.stderr.splitlines() if "no space left" in ln)
        assert line.strip().startswith(f"{h1.name}: data prefetch into {folder}/data failed: no space left for "
                                       "extracting the archive: it needs 1.")
        assert "MB, the folder had 0." in line and "free some space there or choose another data dir" in line
        # The tmpfs is in the host's mount namespace only: look from there.
        names = h1.run(["ls", "-A", f"{folder}/data"]).stdout.split()
        # The verified download and the folder's lock (backends/docker_ssh/datalock.py); no partial folder, no marker.
        assert names == [".ddp-cifar.lock", "cifar-10-python.tar.gz"], names
        assert job_containers(target, job) == []
        h1.run(["mount", "-o", "remount,size=8m", folder])
        again = orchestrate(target, state, *up_args(hosts, data, job, "--min-free-gb", "0", trainer=("--epochs", "1")),
                            timeout=600)
        assert again.returncode == 0, again.stderr
        assert f"data on {h1.name}: downloaded 0 bytes" in again.stdout  # the archive kept, extracted now
        assert h1.run(["cat", f"{folder}/data/.ddp-cifar-verified"]).stdout.strip() == data.md5
    finally:
        orchestrate(target, state, "kill", "--hosts", str(hosts), "--job", job, "--grace", "5")
        h1.run(["umount", folder], check=False)


def test_a_data_folder_too_small_for_staging_fails_in_one_line_and_the_next_up_completes(
        target: Cluster, work: Path) -> None:
    """`--data-from DIR` into host 1's data folder, a 2 MB tmpfs in its own mount namespace, with 3 MB to send:
    one line with the host, the folder and the MB needed and free; nothing partial left, nothing recorded as
    staged; with more room the next `up` completes."""
    state, h1 = work / "state-stage-full", target.hosts[1]
    folder = "/mnt/stage-full"
    hosts = target.write_hosts_file(work / "hosts-stage-full.txt", keys={0: {"data_dir": "/tmp/stage-full/data"},
                                                                        1: {"data_dir": f"{folder}/data"}})
    src = work / "stage-full-src"
    src.mkdir()
    (src / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    (src / "big.bin").write_bytes(bytes(range(256)) * 12_000)  # 3,072,000 bytes
    uid = h1.run(["id", "-u", target.user]).stdout.strip()
    h1.run(["mkdir", "-p", folder])
    h1.run(["mount", "-t", "tmpfs", "-o", f"size=2m,uid={uid},mode=0755", "tmpfs", folder])

    def stage() -> subprocess.CompletedProcess[str]:
        return orchestrate(target, state, "up", "--hosts", str(hosts), "--job", "stage-full", "--gpus", "0",
                           "--image", example_image("charlm"), "--entry", "-m charlm.train", "--data-from", str(src),
                           "--min-free-gb", "0", "--grace", "30", "--", *CHARLM_ARGS, timeout=600)
    try:
        full = stage()
        assert full.returncode != 0
        line = next(ln for ln in full.stderr.splitlines() if "no space left" in ln)
        assert line.strip().startswith(f"{h1.name}: data staging into {folder}/data failed: no space left for the "
                                       "changed files: they need 3.1 MB, the folder had 2.")
        assert line.strip().endswith("MB free; free some space there or choose another data dir")
        # The tmpfs is in the host's mount namespace only: look from there. Nothing partial, no record.
        assert h1.run(["ls", "-A", f"{folder}/data"]).stdout.split() == [".ddp-cifar.lock"]
        assert job_containers(target, "stage-full") == []
        h1.run(["mount", "-o", "remount,size=8m", folder])
        again = stage()
        assert again.returncode == 0, again.stderr
        assert f"data on {h1.name}: 2 of 2 files changed, {1680 + 3_072_000} bytes sent" in again.stdout
        assert f"data on {target.hosts[0].name}: up to date, nothing moved (2 files)" in again.stdout
        assert "DONE step=3" in again.stdout
    finally:
        orchestrate(target, state, "kill", "--hosts", str(hosts), "--job", "stage-full", "--grace", "5")
        h1.run(["umount", folder], check=False)
