"""The Slurm allocator on a real Slurm (devcluster --slurm: slurmctld, slurmd, munge, sshd, dockerd per host) and
torchrun in the job's containers: `submit` queues, the batch script runs `up --hosts slurm` on the first node, the
job trains to its end, and `status`/`kill` show and end it on both sides.

Needs root, slurm-wlm, munge and the CPU image. The batch job runs as root on the first host, in that host's mount
namespace: the machine's /root (where this Python lives) and /tmp (where a fresh clone may be) are not there, so the
orchestrator is installed into the cluster's folder, which every host sees, as a site installs it on shared storage
(tests/kit/shared_install.py), and the batch job runs the system's python3 on it; its state and working folder are
there too (docs/slurm.md: "The test cluster").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.image_kit import build_changed_image
from kit.orchestrate_kit import (
    IMAGE,
    TRAIN,
    Data,
    bounded,
    job_containers,
    job_dir,
    manifests,
    throttle_job,
    wait_for,
)
from kit.slurm_kit import (
    SYSTEM_PYTHON,
    env,
    orchestrate,
    slurm_cluster,
    slurm_state,
    slurm_story,
    submit,
    wait_for_end,
)

from devcluster import Cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def target() -> Iterator[Cluster]:
    """This module's Slurm cluster: conftest's `data` serves the test data to it."""
    with slurm_cluster() as c:
        yield c


def first_step(c: Cluster, job_id: str, pattern: str = r"epoch \d+ step \d+ ") -> re.Match[str]:
    """Wait for the batch output's first training step line (up streams rank 0's log into it)."""
    out = c.dir / f"slurm-{job_id}.out"

    def found() -> re.Match[str] | None:
        return re.search(pattern, out.read_text()) if out.exists() else None

    try:
        wait_for(found, 150, f"a training step of Slurm job {job_id}")
    except AssertionError as e:
        text = out.read_text(errors="replace") if out.exists() else "(no batch output yet)"
        raise AssertionError(f"{e}\n--- the batch output's last lines\n" + "\n".join(text.splitlines()[-30:]) +
                             f"\n{slurm_story(c, job_id)}") from None
    match = found()
    assert match is not None
    return match


def test_submit_queues_trains_to_the_end_and_leaves_nothing(target: Cluster, data: Data) -> None:
    """Two submits that each take both nodes: the second is PENDING (Resources) in `status` while the first runs,
    and a third of its name is refused. `kill --job` of the first cancels it and removes its containers; the second
    then runs on both nodes with each node's granted GPU and trains to the end: Slurm's COMPLETED, exit 0, no
    container running."""
    c = target
    first = submit(c, data, "first", epochs=50)
    first_step(c, first)
    # It only has to keep the nodes busy while the second waits: a tenth of a core each meanwhile, not the CPU the
    # other tests need (its training is not what this test reads).
    assert throttle_job(c, "first") == 2
    job_id = submit(c, data, "queued", epochs=2)
    wait_for(lambda: f"slurm: job {job_id} PENDING (Resources)" in orchestrate(c, "status", "--job", "queued").stdout,
             30, "status to show the job pending for resources")  # Reason=None until the scheduler's first pass
    assert slurm_state(c, first)[0] == "RUNNING"
    again = orchestrate(c, "submit", "--nodes", "2", "--python", SYSTEM_PYTHON, "--job", "queued")
    assert again.returncode == 2 and f"job 'queued' is already queued or running under Slurm (job {job_id}," \
        in again.stderr
    kill = orchestrate(c, "kill", "--job", "first")
    assert kill.returncode == 0 and f"slurm: cancelled job {first} (was RUNNING on dc-{c.name}-h[0-1])" \
        in kill.stdout, kill.stdout
    assert job_containers(c, "first") == []
    out = c.dir / f"slurm-{job_id}.out"
    first_step(c, job_id)
    assert slurm_state(c, first)[0] == "CANCELLED"
    wait_for(lambda: "finished: epochs=2 " in out.read_text(), 240, "the queued job to train to its end")
    wait_for_end(c, job_id)
    text = out.read_text()
    assert slurm_state(c, job_id) == ("COMPLETED", "0:0"), text
    hosts = (c.dir / "orch-state" / "ddp-cifar" / "jobs" / f"slurm-{job_id}.hosts").read_text()
    granted = re.findall(r"^(\S+) slots=1 gpu_ids=(\d)$", hosts, re.MULTILINE)
    assert [name for name, _ in granted] == [h.name for h in c.hosts], hosts
    containers = dict(job_containers(c, "queued"))  # kept after a normal end, for `logs`; none runs
    assert sorted(containers) == [h.name for h in c.hosts]
    for name, idx in granted:  # each node's container was given the GPU Slurm granted on that node
        container = containers[name]
        env = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])  # type: ignore[attr-defined]
        assert env["NVIDIA_VISIBLE_DEVICES"] == idx and container.labels["ddp-cifar.gpus"] == idx  # type: ignore[attr-defined]
        assert container.attrs["State"]["Status"] == "exited"  # type: ignore[attr-defined]
        assert container.attrs["State"]["ExitCode"] == 0  # type: ignore[attr-defined]


# Every rank's stop line in its own log (trainer/loop.py: a warning, which every rank logs, with its global rank)
STOP = re.compile(r"\[rank (\d+)\] WARNING stopped by SIGTERM at step (\d+)")


def run_folders(c: Cluster, job: str) -> set[Path]:
    """Every node's torchrun run folders of the job so far (<log dir>/<run id>_<random>/, one per start)."""
    return {run for node in range(len(c.hosts)) if (logs := job_dir(c, node, job, "logs")).is_dir()
            for run in logs.iterdir() if run.is_dir()}


def stop_steps(c: Cluster, job: str, earlier: set[Path]) -> dict[int, list[int]]:
    """Global rank -> the steps at which it logged its stop, read from the run folders not in `earlier`: this
    run's own, not an earlier run's of the same job name."""
    found: dict[int, list[int]] = {}
    for run in run_folders(c, job) - earlier:
        for log in run.rglob("stderr.log"):
            for rank, step in STOP.findall(log.read_text(errors="replace")):
                found.setdefault(int(rank), []).append(int(step))
    return found


def every_rank_stopped_at_the_newest_checkpoint(c: Cluster, job: str, earlier: set[Path], after: int = -1) -> int:
    """Each of the 2 ranks of this run (the run folders not in `earlier`) logged one stop, all at the same step
    (after step `after`), and the newest checkpoint on node 0 (rank 0 writes them) is of that step: the stop's own,
    not an earlier epoch's. Returns that step. Exit codes are no evidence: a crash when a peer dies gives them too."""
    stops = stop_steps(c, job, earlier)
    steps = {step for each in stops.values() for step in each}
    newest = max((int(str(m["step"])) for m in manifests(job_dir(c, 0, job))), default=None)
    every_rank_once = sorted(stops) == [0, 1] and all(len(each) == 1 for each in stops.values())
    one_step = len(steps) == 1 and min(steps) > after
    # one assertion, so that a failure shows every part that is false, and what each rank of this run said last
    assert (every_rank_once, one_step, newest in steps) == (True, True, True), \
        f"stop lines per rank {stops}; newest checkpoint step {newest}\n" + last_lines(c, job, earlier)
    return steps.pop()


def last_lines(c: Cluster, job: str, earlier: set[Path]) -> str:
    """The last lines of each rank's stderr in this run's folders (not in `earlier`): why a stop went otherwise."""
    return "\n".join(f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-12:])
                     for run in sorted(run_folders(c, job) - earlier) for log in sorted(run.rglob("stderr.log")))


def stopped_with_a_checkpoint(c: Cluster, job_id: str, state: str, earlier: set[Path], within: float = 60,
                              after: int = -1) -> int:
    """After Slurm's SIGTERM (which comes within `within` s): the batch script stopped the job everywhere, no
    container runs, every rank of this run (its run folders: not in `earlier`) logged its stop at one step after
    `after`, whose checkpoint is the newest; Slurm's final state is `state`. Returns that step."""
    output = c.dir / f"slurm-{job_id}.out"
    stop_line = f"slurm job {job_id}: SIGTERM; stopping job long on every node"
    wait_for(lambda: stop_line in output.read_text() and job_containers(c, "long") == [], within,
             "the batch script's stop to end every container of the job")  # stopped and removed on every node
    wait_for_end(c, job_id)
    out = output.read_text()
    assert slurm_state(c, job_id)[0] == state, out
    return every_rank_stopped_at_the_newest_checkpoint(c, "long", earlier, after)


def test_slurms_sigterm_stops_every_container_with_a_checkpoint_and_submit_resume_continues(
        target: Cluster, data: Data) -> None:
    """A real time limit shorter than the training: `submit --time 3 --stop-grace 15` asks for
    `--signal=B:TERM@75`, which Slurm sends the batch shell 45 to 105 s into the job (its timers fire up to 60 s
    early, never late: with `--time 2` it came before the first step on a loaded machine, and a 5 s grace was too
    short there for the checkpoint); nothing else signals it. Then a `scancel` by hand. Each time the batch script stops every container
    and every rank logs its stop at one step, whose checkpoint is the newest (the stop's own); `submit --resume`
    continues from it. Only each run's own run folders are read: the resumed run keeps the job's name. While it runs, `status` shows Slurm's
    state beside ours."""
    c = target
    # 1000 epochs (minutes of training): the limit's signal ends it, however fast the machine is
    earlier = run_folders(c, "long")  # none: the job name is this test's alone
    job_id = submit(c, data, "long", "--time", "3", "--stop-grace", "15", epochs=1000)
    first_step(c, job_id)
    # It only has to train until Slurm's signal (45-105 s): at a tenth of a core per container meanwhile, its
    # steps still take well under a second, so the stop's agreement (every 8 steps) is seconds, not the grace.
    assert throttle_job(c, "long") == 2
    status = orchestrate(c, "status", "--job", "long")  # Slurm's state above our table of the ranks
    assert f"slurm: job {job_id} RUNNING on dc-{c.name}-h[0-1]\n" in status.stdout, status.stdout
    assert "long-node1-ddp" in status.stdout, status.stdout
    # The signal comes by 105 s; the stop then takes the grace and the removal, long before the limit (180 s).
    step = stopped_with_a_checkpoint(c, job_id, "FAILED", earlier, within=160)
    # The script's exit 143 (stopped by SIGTERM), not TIMEOUT: the job ended before its limit.
    assert slurm_state(c, job_id) == ("FAILED", "143:0")
    record = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                            env=c.client_env(), cwd="/", check=True).stdout
    print(re.findall(r"(?:RunTime|TimeLimit)=\S+", record))  # how long before the limit it stopped
    earlier = run_folders(c, "long")  # the first run's logs and checkpoints stay: only what the resumed run adds
    job_id = submit(c, data, "long", "--resume", epochs=1000)
    assert int(first_step(c, job_id, r"epoch \d+ step (\d+) ").group(1)) == step + 1
    subprocess.run(["scancel", job_id], env=c.client_env(), cwd="/", check=True, timeout=30)
    stopped_with_a_checkpoint(c, job_id, "CANCELLED", earlier, after=step)


def test_up_inside_salloc_takes_the_allocation_and_each_nodes_own_gpu(target: Cluster, data: Data) -> None:
    """`up` with no --hosts inside `salloc -N2 --gpus-per-node 1`, where another job holds GPU 0 of the first node
    only: the nodes are the allocation's, and each container gets the index Slurm granted on its node (1, then
    0). Both ask for a little memory, so that they share the node (without --mem a job takes it whole)."""
    c = target
    holder = subprocess.run(["sbatch", "--parsable", "-w", c.hosts[0].name, "--gpus-per-node", "1", "--mem", "64",
                             "-o", "/dev/null", "--wrap", "sleep 300"], env=c.client_env(), cwd="/", check=True,
                            capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        wait_for(lambda: slurm_state(c, holder)[0] == "RUNNING", 30, "the job holding GPU 0 of the first node")
        res = subprocess.run(["salloc", "-N2", "--gpus-per-node", "1", "--mem", "64", "--immediate=60",
                              sys.executable, "-m", "orchestrate", "up", "--job", "inside", "--image", IMAGE,
                              "--data-url", data.url, "--data-md5", data.md5,
                              "--", *TRAIN, "--epochs", "1", "--max-steps", "2"],
                             env=env(c), cwd=c.dir, capture_output=True, text=True, timeout=bounded(240))
        print(res.stdout, res.stderr)
        assert res.returncode == 0, res.stderr
    finally:
        subprocess.run(["scancel", holder], env=c.client_env(), cwd="/", check=True, timeout=30)
    containers = dict(job_containers(c, "inside"))
    assert sorted(containers) == [h.name for h in c.hosts]
    given = [containers[h.name].labels["ddp-cifar.gpus"] for h in c.hosts]  # type: ignore[attr-defined]
    assert given == ["1", "0"], res.stdout


def batch_process_tree(job_id: str) -> list[int]:
    """The batch script of Slurm job `job_id` (slurmd's copy of it, in its spool) and every process under it:
    `up`, and the srun that started the guards. The hosts share the machine's pid namespace."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # `pid (comm) state ppid ...`
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # ended while read
            continue
    script = f"/spool/job{int(job_id):05d}/slurm_script".encode()
    tree = [p for p in parents if script in _cmdline(p)]
    for pid in tree:  # grows while walked: children of children
        tree += [child for child, parent in parents.items() if parent == pid and child not in tree]
    return tree


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_batch_scripts_death_fails_the_job_and_the_guards_end_its_containers(
        target: Cluster, data: Data) -> None:
    """The batch script and `up` killed with SIGKILL on the first node: nothing runs the script's stop, but Slurm
    ends the job (FAILED; no requeue), and each node's guard step ends the job's containers there within its grace
    (docker kill: 137; a container may end first on the loss of its peer): none runs anywhere. Node 0 lost
    outright (srun dies too, and Slurm may SIGKILL the guards): the next test."""
    c = target
    job_id = submit(c, data, "orphan", "--stop-grace", "5", epochs=1000)  # ended by its guards, never by itself
    first_step(c, job_id)
    tree = batch_process_tree(job_id)
    out = (c.dir / f"slurm-{job_id}.out").read_text()
    assert len(tree) >= 3, f"{tree}: not the script, up and srun; the batch output:\n" + \
        "\n".join(line for line in out.splitlines() if not line.startswith("[node"))
    for pid in tree:  # srun lives on: with it killed too (node 0 lost), Slurm SIGKILLed the guards now and then
        if b"srun" not in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    # Slurm ends the job at once and SIGTERMs its steps; each guard ends its node's container within its grace + 5 s,
    # or Slurm's KillWait (30 s) ends the guard: well within a minute, and a loaded machine's slowness.
    killed = time.monotonic()
    wait_for(lambda: not any(ct.status == "running" for _, ct in job_containers(c, "orphan")),  # type: ignore[attr-defined]
             90, "the guards to end the job's containers")
    print(f"no container of the job runs {time.monotonic() - killed:.1f} s after the batch script's death")
    wait_for_end(c, job_id)  # its state may read FAILED while the guards still run
    assert slurm_state(c, job_id)[0] == "FAILED"
    states = {n: ct.attrs["State"] for n, ct in job_containers(c, "orphan")}  # type: ignore[attr-defined]
    # None ended on its own: a guard killed its node's container (docker kill: 137), and the guards work each on
    # its own node, so a container whose guard came later may have ended first on the loss of its peer (torchrun's
    # exit 1, seen 0.5 s after the other node's kill).
    out = (c.dir / f"slurm-{job_id}.out").read_text()
    codes = sorted(s["ExitCode"] for s in states.values())
    assert sorted(states) == [h.name for h in c.hosts] and 137 in codes and set(codes) <= {1, 137}, \
        f"{states}; the batch output:\n" + "\n".join(line for line in out.splitlines() if not line.startswith("[node"))


def guard_processes(job: str) -> list[int]:
    """Each node's guard of `job` (bash -c GUARD guard.sh JOB GRACE, under its slurmstepd; srun's own command line,
    which holds the same words, is srun's). Not a guard's subshell: bash forks one for each `$(...)` (its `docker ps`
    every few seconds), with the guard's command line; seen in CI as a third guard."""
    mark = f"\0guard.sh\0{job}\0".encode()
    found = [int(p.name) for p in Path("/proc").glob("[0-9]*")
             if mark in (line := _cmdline(int(p.name))) and line.split(b"\0")[0].endswith(b"bash")]
    return [pid for pid in found if _parent(pid) not in found]


def _parent(pid: int) -> int:
    try:  # `pid (comm) state ppid ...`
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:  # ended while read
        return 0


def test_node_0_lost_and_its_guards_sigkilled_the_containers_stop_themselves_when_their_lease_lapses(
        target: Cluster, data: Data) -> None:
    """Node 0 lost outright (its batch script, `up` and the guards' srun killed) and every guard SIGKILLed, so no
    trap runs (Slurm did that to the guards in about 1 run of 4 without the SIGKILLs): no one stops the containers,
    but each stops itself once its lease lapses (DDP_LEASE_S, 15 s here) with SIGTERM and a checkpoint, within the
    lease, a renewal and the stop. None runs on. The evidence of the clean stop is each rank's own stop line (read
    from every node's logs of this run), all at one step, and that step's checkpoint the newest: exit codes are not,
    since a container that crashed on its peer's death exits 1 too."""
    c, job, lease_s = target, "lost", 15
    earlier = run_folders(c, job)  # none: the job name is this test's alone
    job_id = submit(c, data, job, "--env", f"DDP_LEASE_S={lease_s}", epochs=1000)  # ended by its lease only
    first_step(c, job_id)
    guards, tree = guard_processes(job), batch_process_tree(job_id)
    assert len(guards) == 2 and len(tree) >= 3, f"guards {guards}, batch script, up and srun {tree}"
    for pid in guards + tree:  # the guards first: they must get no SIGTERM from the others' end
        os.kill(pid, signal.SIGKILL)
    lost = time.monotonic()
    # The last renewal came up to 5 s before the kill; the watcher looks each second; the stop takes a few seconds.
    wait_for(lambda: not any(ct.status == "running" for _, ct in job_containers(c, job)),  # type: ignore[attr-defined]
             lease_s + 60, "the containers to stop themselves when their leases lapse")
    wait_for_end(c, job_id)
    containers = job_containers(c, job)
    said = {n: ct.logs().decode(errors="replace") for n, ct in containers}  # type: ignore[attr-defined]
    lapsed = [n for n, text in said.items() if f"not renewed for {lease_s} s (its guard is gone): SIGTERM" in text]
    print(f"Slurm's job {slurm_state(c, job_id)}; every container ended {time.monotonic() - lost:.1f} s after "
          f"the guards' death (lease {lease_s} s); leases lapsed on {lapsed}")
    assert sorted(n for n, _ in containers) == [h.name for h in c.hosts]
    for name, ct in containers:
        logs = ct.logs().decode(errors="replace")  # type: ignore[attr-defined]
        # ended by itself (no kill: 137): torchrun exits 1 once its workers stopped, or 143 when the watcher's SIGTERM
        # reached it while they did (seen in CI: 143 with "stopped by SIGTERM at step 56" in the same log)
        assert ct.attrs["State"]["ExitCode"] in (1, 143), f"{name}: {ct.attrs['State']}\n{logs[-3000:]}"  # type: ignore[attr-defined]
    # Each stops itself; a container whose peer's lease lapsed first may have stopped with it (the ranks agree).
    assert lapsed, said
    # The evidence of a clean stop (a container that crashed on its peer's death exits 1 too): every rank's stop
    # line, at one step, and that step's checkpoint the newest (the per-epoch ones are older).
    step = every_rank_stopped_at_the_newest_checkpoint(c, job, earlier)
    print(f"every rank stopped at step {step}, its checkpoint the newest")


def test_submit_brings_an_image_the_nodes_lack_through_the_shared_storage(target: Cluster, data: Data) -> None:
    """README's order: build the image here, then `submit`. The nodes hold the previous build (the module's cluster
    is seeded with it), not this one: `submit` writes the image's layers to the storage every node sees before
    sbatch, the batch job's `up` loads on the first node only the layer it lacks, and sends node 1 its missing layer
    as `up` does; both nodes run the new image. (Before: preflight refused, `missing here and on this machine`.)"""
    c = target
    tag = f"{IMAGE}-submitted"
    image_id = build_changed_image(IMAGE, tag, line=f"submitted {uuid.uuid4().hex}")  # new to every cache
    try:
        layers = len(docker.from_env().images.get(tag).attrs["RootFS"]["Layers"])
        job_id = submit(c, data, "carried", epochs=1, image=tag, trainer=("--max-steps", "2"))
        wait_for(lambda: slurm_state(c, job_id)[0] not in ("PENDING", "RUNNING", "COMPLETING"), 240,
                 "the job to end")
        text = (c.dir / f"slurm-{job_id}.out").read_text()
        assert slurm_state(c, job_id) == ("COMPLETED", "0:0"), text
        h0, h1 = c.hosts
        assert re.search(rf"^image {re.escape(tag)} on {h0.name}: loaded 1 of {layers} layers \([\d.]+ MB\) from ",
                         text, re.M), text
        assert re.search(rf"^image {re.escape(tag)} on {h1.name}: sent [\d.]+ MB \(1 of {layers} layers\)", text,
                         re.M), text
        ran = {name: cont.attrs["Image"] for name, cont in job_containers(c, "carried")}  # type: ignore[attr-defined]
        assert ran == {h.name: image_id for h in c.hosts}
    finally:
        docker.from_env().images.remove(tag, noprune=False)
