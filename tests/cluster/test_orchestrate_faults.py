"""Faults on real test hosts: a node's container is SIGKILLed, a host's link goes down; plus hostile input.

`up` stays attached and watches every container: the failing node is named with its last lines, the job is
stopped on every other node (well within 60 s, instead of hanging until a collective times out), no container
of the job is left where the orchestrator can reach, and `up` exits non-zero. `up --resume` then finishes.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kit.gated_orchestrate import RESTART_GATE_ENV
from kit.orchestrate_kit import (
    PATIENCE,
    Data,
    Up,
    crash_image,
    job_containers,
    job_dir,
    kill_process_group,
    manifests,
    orch_env,
    orchestrate,
    sigterm_step,
    spawn,
    start,
    up_args,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


def running(cluster: Cluster, job: str) -> int:
    return len([c for _, c in job_containers(cluster, job) if c.status == "running"])


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, float]:
    """Wait for the attached `up` to exit; return its exit code, output and how long it took."""
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"up still attached after {timeout:.0f} s:\n{out}") from None
    print(out)
    return proc.returncode, out, time.monotonic() - t0


def test_node_container_sigkilled_then_resume(cluster: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state, ckpt = work / "state", job_dir(cluster, 0, "crash")
    proc = start(cluster, state, *up_args(hosts, data, "crash", trainer=("--epochs", "40")))
    try:
        wait_for(lambda: running(cluster, "crash") == 2 and len(manifests(ckpt)) >= 1, PATIENCE,
                 "the job to run and write a checkpoint")
        victim = cluster.hosts[1].docker_client()
        victim.containers.get(f"crash-node1-{cluster.user}").kill(signal="SIGKILL")
        victim.close()
        code, out, took = finish(proc, 120)
    finally:
        kill_process_group(proc, signal.SIGKILL)
    assert code != 0
    assert f"node 1 ({cluster.hosts[1].name}) failed: exited with code 137" in out
    assert "last lines of node 1:" in out
    assert took < 60, f"others stopped only after {took:.0f} s"
    assert job_containers(cluster, "crash") == []  # nothing of the job left anywhere
    stopped_at = max(m["step"] for m in manifests(ckpt))
    epoch_at = max(m["epoch"] for m in manifests(ckpt))
    resumed = orchestrate(cluster, state, *up_args(hosts, data, "crash", "--resume",
                                                   trainer=("--epochs", str(int(epoch_at) + 1))), timeout=600)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout
    assert max(m["step"] for m in manifests(ckpt)) > stopped_at


def test_link_down_mid_run(cluster: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state = work / "state"
    h1 = cluster.hosts[1]
    proc = start(cluster, state, *up_args(hosts, data, "cut", trainer=("--epochs", "40")))
    try:
        wait_for(lambda: running(cluster, "cut") == 2 and len(manifests(job_dir(cluster, 0, "cut"))) >= 1, PATIENCE,
                 "the job to run and write a checkpoint")
        h1.link_down()
        try:
            code, out, took = finish(proc, 150)
            assert code != 0
            assert f"node 1 ({h1.name}) failed: host unreachable" in out
            assert not [c for h, c in job_containers(cluster, "cut") if h == cluster.hosts[0].name]
            # kill with the host still down: stops what it reaches, names the unreachable host, non-zero.
            killed = orchestrate(cluster, state, "kill", "--job", "cut", "--grace", "5")
            assert killed.returncode != 0
            assert any(ln.strip().startswith(f"{h1.name}:") for ln in killed.stderr.splitlines())
        finally:
            h1.link_up()
    finally:
        kill_process_group(proc, signal.SIGKILL)
    cleaned = orchestrate(cluster, state, "kill", "--job", "cut", "--grace", "5")
    assert cleaned.returncode == 0 and job_containers(cluster, "cut") == []


def test_a_dropped_ssh_connection_is_opened_again_and_the_job_finishes(cluster: Cluster, work: Path, data: Data,
                                                                      hosts: Path) -> None:
    """The SSH connection to the master's host ends under a running job while the host still answers (a reset
    by a firewall, a killed session): `up` connects again and the job ends as a success, never as a lost host."""
    state, h0 = work / "state", cluster.hosts[0]
    proc = start(cluster, state, *up_args(hosts, data, "drop", trainer=("--epochs", "20")))
    try:
        wait_for(lambda: running(cluster, "drop") == 2 and len(manifests(job_dir(cluster, 0, "drop"))) >= 1, PATIENCE,
                 "the job to run and write a checkpoint")
        # The login's own sshd processes are the connections' ends on the host; the listener (root) stays. The
        # test hosts share this machine's process table: only those in h0's network namespace (--ns $$).
        dropped = h0.run(["sh", "-c", f"pkill -KILL -u {h0.user} -x sshd --ns $$ --nslist net"], check=False)
        assert dropped.returncode == 0, "no sshd session of the login was found on the host"
        code, out, _ = finish(proc, PATIENCE)
    finally:
        kill_process_group(proc, signal.SIGKILL)
    assert "connection was dropped; connecting again" in out
    assert code == 0, out
    assert "unreachable" not in out and "DONE" in out
    # node 0's log was followed again from where it broke: every epoch's line, none twice
    assert [out.count(f"[rank 0] INFO epoch {e}/20 step ") for e in range(1, 21)] == [1] * 20


def test_hostile_values_run_nothing_and_secrets_are_masked(cluster: Cluster, work: Path, data: Data,
                                                           hosts: Path, tmp_path: Path) -> None:
    """Paths and --env values with shell metacharacters reach the hosts as plain data; secrets never show."""
    marker = tmp_path / "owned"
    evil = f"$(touch {marker}); `touch {marker}`\ntouch {marker} & touch {marker}"
    # Under the login's home on the hosts (a /tmp/pytest-... folder there may belong to root from another test).
    ckpt_dir = f"{cluster.hosts[0].home}/hostile-{tmp_path.name}/ck $(touch {marker});`touch {marker}`/{{job}}"
    secret = "s3cr3tmodel"  # shaped like a torchvision name: up lets it pass, the image has no torchvision
    state = work / "state"
    common = ["--ckpt-dir", ckpt_dir, "--env", f"EVIL={evil}", "--env", f"API_TOKEN={secret}"]
    hostile_hosts = hosts  # the hosts file names no dirs: the hostile --ckpt-dir is used
    # The model name is the secret, so the trainer's own error line (in the container) carries it: masked.
    trainer = ("--epochs", "1", "--model", secret)
    attached = orchestrate(cluster, state, *up_args(hostile_hosts, data, "hostile", *common, trainer=trainer))
    assert attached.returncode != 0 and "failed: exited with code" in attached.stderr + attached.stdout
    assert secret not in attached.stdout + attached.stderr and "****" in attached.stdout
    assert job_containers(cluster, "hostile") == []

    detached = orchestrate(cluster, state, *up_args(hostile_hosts, data, "hostile", "--detach", *common,
                                                    trainer=trainer))
    assert detached.returncode == 0
    wait_for(lambda: running(cluster, "hostile") == 0, PATIENCE, "the trainer to refuse the model")
    status = orchestrate(cluster, state, "status", "--job", "hostile")
    logs = orchestrate(cluster, state, "logs", "--job", "hostile")
    dry = orchestrate(cluster, state, *up_args(hostile_hosts, data, "hostile", "--dry-run", *common, trainer=trainer))
    for res in (status, logs, dry):
        assert res.returncode == 0 and secret not in res.stdout
    assert "****" in logs.stdout and "API_TOKEN=****" in dry.stdout
    for _, c in job_containers(cluster, "hostile"):
        env = dict(e.split("=", 1) for e in c.attrs["Config"]["Env"])
        assert env["EVIL"] == evil and env["API_TOKEN"] == secret  # the container got the values, verbatim
    orchestrate(cluster, state, "kill", "--job", "hostile", "--grace", "5")
    assert not marker.exists() and not any(h.path(str(marker)).exists() for h in cluster.hosts)
    assert cluster.hosts[0].path(ckpt_dir.replace("{job}", "hostile")).is_dir()  # created under its literal name


def test_ctrl_c_stops_the_job_and_logs_follow_ends_with_it(cluster: Cluster, work: Path, data: Data,
                                                           hosts: Path) -> None:
    """Ctrl-C on an attached `up --stop-on-interrupt` stops the job everywhere (SIGTERM first, so the trainer
    writes a checkpoint); a `logs -f` running beside it follows the node's lines and ends when the job does."""
    state, ckpt = work / "state", job_dir(cluster, 0, "intr")
    up = start(cluster, state, *up_args(hosts, data, "intr", "--stop-on-interrupt", trainer=("--epochs", "40")))
    follow = None
    try:
        # Training for real (a first checkpoint exists): a SIGTERM before the first step has nothing to save.
        wait_for(lambda: running(cluster, "intr") == 2 and len(manifests(ckpt)) >= 1, PATIENCE,
                 "the job to run and write a checkpoint")
        follow = start(cluster, state, "logs", "-f", "--job", "intr", "--node", "0")
        first = max(m["step"] for m in manifests(ckpt))
        wait_for(lambda: max(m["step"] for m in manifests(ckpt)) > first, PATIENCE, "the trainer to go on training")
        kill_process_group(up, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
        code, out, _ = finish(up, 120)
        followed, _ = follow.communicate(timeout=60)  # ends by itself once the containers are gone
    finally:
        kill_process_group(up, signal.SIGKILL)
        if follow is not None:
            kill_process_group(follow, signal.SIGKILL)
    assert code != 0 and "stopped by Ctrl-C" in out
    assert job_containers(cluster, "intr") == []
    # The checkpoint written on the way out is the newest, at exactly the step the trainer says it stopped at.
    stopped = sigterm_step(cluster, 0, "intr")
    assert stopped is not None and max(m["step"] for m in manifests(ckpt)) == stopped
    assert follow.returncode == 0
    assert any(line.startswith("[node 0] ") for line in followed.splitlines())
    assert not any(line.startswith("[node 1] ") for line in followed.splitlines())  # --node 0 only


def test_ctrl_c_during_the_restart_backoff_ends_it_all(cluster: Cluster, work: Path, data: Data,
                                                       hosts: Path) -> None:
    """Ctrl-C while `up` waits out the backoff after a failed node (a crash injected at step 2), sent as soon as the
    backoff's line shows: nothing restarts, `up` says why and exits 1, no container is left."""
    job = "intr-backoff"
    up = Up(start(cluster, work / "state", *up_args(hosts, data, job, "--max-restarts", "2", "--env", "CRASH_AT_STEP=2",
                                                    trainer=("--epochs", "5"), image=crash_image())))
    try:
        up.wait_for_line("restart 1 of 2 in", PATIENCE, "the restart backoff")
        kill_process_group(up.proc, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
        code = up.wait(120)
    finally:
        kill_process_group(up.proc, signal.SIGKILL)
    assert code == 1, up.text
    assert f"job {job!r}: Ctrl-C during the restart backoff; nothing runs, no restart follows" in up.text
    assert "--- restart 1" not in up.text and job_containers(cluster, job) == []


def test_a_kill_after_the_backoffs_last_look_removes_the_containers_just_started(
        cluster: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """The window the backoff's once-a-second look leaves open: a `kill` (from another machine: its own state dir)
    after the last look and before the restart's containers exist. The restart gate of the kit's entry
    (tests/kit/gated_orchestrate.py, a Pauses of orchestrate/pauses.py) holds `up` in that window until the kill
    has run, every time; the look right after the start sees the kill's stop record, the new containers are
    removed and nothing restarts again."""
    job, gate = "kill-race", work / "restart-gate"
    env = {**orch_env(cluster, work / "state-race"), RESTART_GATE_ENV: str(gate)}
    up = Up(spawn(up_args(hosts, data, job, "--max-restarts", "2", "--env", "CRASH_AT_STEP=2",
                          trainer=("--epochs", "5"), image=crash_image()), env, merge_stderr=True))
    try:
        wait_for(lambda: Path(f"{gate}.reached").exists() or up.proc.poll() is not None, PATIENCE,
                 "the restart at its gate")
        killed = orchestrate(cluster, work / "state-elsewhere", "kill", "--job", job, "--hosts", str(hosts))
        released = int(time.time())
        gate.touch()
        code = up.wait(PATIENCE)
    finally:
        kill_process_group(up.proc, signal.SIGKILL)
    assert killed.returncode == 0 and code == 1, up.text
    assert "--- restart 1 of 2 ---" in up.text
    assert f"job {job!r} was stopped with 'kill' as it started; its containers were removed" in up.text
    assert "--- restart 2" not in up.text and job_containers(cluster, job) == []
    # The restart's containers were created after the kill and removed by `up` (the attempt before was gone).
    assert sorted(container_events(cluster, job, released)) == ["create", "create", "destroy", "destroy"]


def container_events(cluster: Cluster, job: str, since: int) -> list[str]:
    """The create and destroy events of the job's containers on every host since `since` (Unix seconds)."""
    seen = []
    for host in cluster.hosts:
        client = host.docker_client()
        try:
            seen += [e["Action"] for e in client.events(since=since, until=int(time.time()) + 1, decode=True,
                                                         filters={"type": "container", "label": f"ddp-cifar.job={job}"})
                     if e["Action"] in ("create", "destroy")]
        finally:
            client.close()
    return seen


def test_a_host_allowing_3_sessions_refuses_channels_and_up_opens_more_connections(
        cluster: Cluster, work: Path, data: Data, hosts: Path) -> None:
    """Host 1's sshd differs from stock for this test only: MaxSessions 3 instead of 10, as a hardened site sets it.
    `up` holds up to 7 channels on a host at once here, so sshd really refuses some ("no more sessions" in its log);
    each refusal makes `up` open another connection to the host, and the job runs to its end."""
    host, sshd_log = cluster.hosts[1], cluster.hosts[1].layout.log_dir / "sshd.log"
    refused_before = sshd_log.read_text().count("no more sessions")
    host.restart_sshd("MaxSessions 3")
    try:
        res = orchestrate(cluster, work / "state", *up_args(hosts, data, "few-sessions", "--timings",
                                                            trainer=("--epochs", "1")))
    finally:
        host.restart_sshd()
    assert res.returncode == 0, res.stderr
    assert sshd_log.read_text().count("no more sessions") > refused_before
    peak = dict(re.findall(r"(\S+) (\d+)", res.stdout.split("peak SSH channels per host:", 1)[1].splitlines()[0]))
    assert int(peak[host.name]) > 3, peak  # more than one connection can hold
    orchestrate(cluster, work / "state", "kill", "--job", "few-sessions")


def test_a_closed_terminal_leaves_the_job_running_to_its_end(cluster: Cluster, work: Path, data: Data,
                                                             hosts: Path) -> None:
    """SIGHUP to an attached `up` (its terminal went away) detaches it, as --detach would: it exits 0 at once,
    prints nothing more and stops nothing; the job trains to its end, which `logs -f` follows and `status` shows."""
    state, ckpt = work / "state", job_dir(cluster, 0, "hup")
    up = start(cluster, state, *up_args(hosts, data, "hup", trainer=("--epochs", "6")))
    try:
        wait_for(lambda: running(cluster, "hup") == 2 and len(manifests(ckpt)) >= 1 or up.poll() is not None, PATIENCE,
                 "the job to run and write a checkpoint")
        assert up.poll() is None, up.communicate()[0]
        kill_process_group(up, signal.SIGHUP)  # what the terminal's going away sends to its foreground group
        code, out, took = finish(up, 60)
    finally:
        kill_process_group(up, signal.SIGKILL)
    assert code == 0 and took < 30, out
    assert "keeps running" not in out and "stopping job" not in out and "error" not in out  # nothing more
    # The hangup stopped nothing: the trainer reaches its last epoch (a stop would end it with SIGTERM, exit 143).
    followed = orchestrate(cluster, state, "logs", "-f", "--job", "hup", "--node", "0", timeout=600)
    assert followed.returncode == 0 and "INFO DONE epochs=6 " in followed.stdout
    status = orchestrate(cluster, state, "status", "--job", "hup")
    rows = [line for line in status.stdout.splitlines() if "hup-node" in line]
    assert status.returncode == 0 and len(rows) == 2 and all("exited" in row for row in rows), status.stdout
    assert [c.attrs["State"]["ExitCode"] for _, c in job_containers(cluster, "hup")] == [0, 0]  # type: ignore[attr-defined]
    orchestrate(cluster, state, "kill", "--job", "hup", "--grace", "5")


def test_a_node_over_its_memory_limit_is_reported_as_oom_and_restarted(cluster: Cluster, work: Path, data: Data,
                                                                       hosts: Path) -> None:
    """A real OOM kill: 64 MB is less than torchrun's `import torch` needs, so the test hosts' dockerd (cgroup v1
    here) has the kernel kill it. `up` names the node, the limit in force and what to do, and leaves nothing. Under
    --max-restarts 1 the OOM is restarted as any failed node is (docs/orchestrate.md, --max-restarts), OOMs again,
    and the run ends after its one restart."""
    res = orchestrate(cluster, work / "state", *up_args(hosts, data, "oom", "--memory", "64m", "--max-restarts", "1",
                                                        trainer=("--epochs", "1")), timeout=PATIENCE)
    assert res.returncode == 1
    oom = (r"node [01] \(\S+\) killed by the kernel's OOM killer: out of its memory limit \(--memory 64m\); lower "
           r"--batch-size, or give it more memory with --memory")
    said = " ".join(res.stdout.split())  # the console wraps lines at 200 columns when piped
    assert re.search(rf"restart 1 of 1 in 10 s, from the newest valid checkpoint; cause: {oom}", said)
    assert "--- restart 1 of 1 ---" in res.stdout
    assert re.search(rf"job 'oom' failed: {oom}.*\(after 1 automatic restart\(s\)\)", res.stderr)
    assert job_containers(cluster, "oom") == []
