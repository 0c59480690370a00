"""`--max-restarts`, `--min-nodes` and checkpoints inside a Slurm allocation, on a real Slurm (devcluster --slurm:
slurmctld, slurmd, munge, sshd, dockerd per host) with torchrun in the job's containers: `submit` hands them to the
batch script's `up --hosts slurm`, which restarts on the allocation's nodes as it does on a hosts file.

With the test data (256 images) and --batch-size 16: 8 steps per epoch on 2 nodes, a checkpoint every epoch (CPU).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from kit.orchestrate_kit import Data, job_containers, job_dir, manifests, wait_for
from kit.slurm_kit import batch_output, slurm_cluster, slurm_state, submit, wait_for_end

from devcluster import Cluster

pytestmark = pytest.mark.cluster
RESTART = "--- restart 1 of 1 ---"
# The first checkpoint (step 8) must come well before the end, so that the fault lands while the job trains: 12
# epochs (96 steps) leave 88 steps for the kill, which follows the checkpoint within 0.1 s and one call (24 steps took
# 2 s on 2 nodes at a load of 7; 6 epochs left an idle fast machine 2-3 s). A stopped dockerd sends its containers
# SIGTERM at once, so 4 epochs leave that enough, and the restart on one node (a quarter as fast) has less to train.
EPOCHS_KILLED, EPOCHS_SHRUNK = 12, 4


@pytest.fixture(scope="module")
def target() -> Iterator[Cluster]:
    """This module's Slurm cluster: conftest's `data` serves the test data to it."""
    with slurm_cluster() as c:
        yield c


def first_checkpoint(c: Cluster, job: str) -> int:
    """Wait for rank 0's first checkpoint on node 0; the newest step saved so far."""
    ckpt = job_dir(c, 0, job)
    wait_for(lambda: manifests(ckpt), 150, f"a first checkpoint of job {job}", every=0.1)
    return max(int(str(m["step"])) for m in manifests(ckpt))


def trained_to_the_end(c: Cluster, job_id: str, epochs: int) -> str:
    """Wait for the batch job's training to end and for Slurm to record it; the batch output. What `up` said is
    printed with the seconds since this wait began at which each line was seen: where a slow run spent its time."""
    began, seen = time.monotonic(), dict[str, float]()

    def ended() -> bool:  # trained to the end, or ended otherwise (Slurm's record says which)
        out = batch_output(c, job_id)
        seen.update({line: time.monotonic() - began for line in said(out) if line not in seen})
        return f"finished: epochs={epochs} " in out or slurm_state(c, job_id)[0] not in ("RUNNING", "COMPLETING")

    try:
        wait_for(ended, 240, f"Slurm job {job_id} to train to its end")  # once 148 s at a load of 4: the bound, not a goal
    finally:
        print("\n".join(f"{t:6.1f} {line}" for line, t in seen.items()))
    wait_for_end(c, job_id)
    out = batch_output(c, job_id)
    assert slurm_state(c, job_id) == ("COMPLETED", "0:0"), told(out)
    return out


def said(out: str) -> list[str]:
    """The lines `up` wrote into the batch output: not the ranks' lines, nor the preflight table's."""
    return [line for line in out.splitlines() if not line.startswith(("[node", "│", "┃", "┏", "┡", "└"))]


def told(out: str) -> str:
    """What `up` said in the batch output: why a run went otherwise."""
    return "up said:\n" + "\n".join(said(out)[-80:])


def restart_part(out: str) -> str:
    """The batch output from the restart on."""
    assert RESTART in out, told(out)
    return out.split(RESTART, 1)[1]


def container_on(c: Cluster, job: str, node: int) -> object:
    """The job's container on host `node`, once there is one."""
    def found() -> list[object]:
        return [ct for host, ct in job_containers(c, job) if host == c.hosts[node].name]

    wait_for(lambda: len(found()) == 1, 150, f"job {job}'s container on host {node}", every=0.2)
    return found()[0]


def restart_container(c: Cluster, job: str, job_id: str, node: int) -> dict[str, str]:
    """The labels of the job's container on host `node`, checked to be the restart's, to have ended with exit 0, and
    to carry the Slurm job's id, by which the guard (guard.sh) knows the containers of its job."""
    container = container_on(c, job, node)
    attrs, labels = container.attrs, container.labels  # type: ignore[attr-defined]
    assert f"ORCHESTRATE_SLURM_JOB={job_id}" in attrs["Config"]["Env"], attrs["Config"]["Env"]
    assert labels["ddp-cifar.restart"] == "1", labels
    assert (attrs["State"]["Status"], attrs["State"]["ExitCode"]) == ("exited", 0), attrs["State"]
    return labels


def test_a_killed_container_in_the_batch_job_restarts_from_the_newest_checkpoint(target: Cluster, data: Data) -> None:
    """`submit --max-restarts 1`; once rank 0 has saved a checkpoint, node 1's container is SIGKILLed (docker kill
    on its host): the batch script's `up` restarts on both nodes of the allocation from the newest checkpoint
    (the one seen, or one saved since), trains to the end, and Slurm says COMPLETED 0:0. The restart's containers
    carry ORCHESTRATE_SLURM_JOB=<id>, as the first start's. --restart-backoff 1 (and in the next test): the default
    10 s only waited; its length is tests/orchestrate/test_restarts.py's."""
    c, job = target, "heal"
    job_id = submit(c, data, job, "--max-restarts", "1", "--restart-backoff", "1", epochs=EPOCHS_KILLED)
    victim = container_on(c, job, 1)  # found first: at the checkpoint only the kill is left to do
    seen = first_checkpoint(c, job)
    victim.kill()  # type: ignore[attr-defined]  # SIGKILL, through host 1's local socket
    killed = time.monotonic()
    out = trained_to_the_end(c, job_id, EPOCHS_KILLED)
    print(f"killed at checkpoint step {seen}; trained to the end {time.monotonic() - killed:.1f} s later")
    after = restart_part(out)  # no restart: the training had ended before the kill
    assert "cause: node 1 (" in out and "exited with code 137" in out, told(out)
    resumed = re.search(r"resuming from \S+ \(epoch \d+, step (\d+),", after)
    assert resumed and int(resumed.group(1)) >= seen, told(after)
    step = re.search(r"epoch \d+ step (\d+) ", after)  # the restart's first step: the one after the checkpoint
    assert step and int(step.group(1)) == int(resumed.group(1)) + 1, after[:3000]
    for node in range(len(c.hosts)):
        assert restart_container(c, job, job_id, node)["ddp-cifar.nnodes"] == "2"


def test_a_node_failing_preflight_at_the_restart_is_left_out_with_min_nodes(target: Cluster, data: Data) -> None:
    """`submit --max-restarts 1 --min-nodes 1`; once rank 0 has saved a checkpoint, host 1's dockerd stops (its
    container ends with it): the attempt fails, host 1 fails the restart's preflight (no Docker daemon) and is left
    out, and the restart trains to the end on node 0 alone; Slurm says COMPLETED 0:0. When node 0's exit (its peer
    lost) is seen before host 1's daemon is, `up` waits up to 60 s for that daemon to come back before it names it
    (watcher.HOST_BACK_S), which is most of this test's time then."""
    c, job = target, "shrink"
    job_id = submit(c, data, job, "--max-restarts", "1", "--restart-backoff", "1", "--min-nodes", "1",
                    epochs=EPOCHS_SHRUNK)
    first_checkpoint(c, job)
    try:
        c.hosts[1].stop_docker()
        stopped = time.monotonic()
        out = trained_to_the_end(c, job_id, EPOCHS_SHRUNK)
        print(f"host 1's dockerd stopped; trained to the end on node 0 {time.monotonic() - stopped:.1f} s later")
    finally:
        c.hosts[1].start_docker()
    after = restart_part(out)
    assert re.search(rf"leaving out \S*{c.hosts[1].name}\S*: ", after), told(after)
    resumed = re.search(r"resuming from \S+ \(epoch \d+, step \d+,", after)
    assert resumed, told(after)
    # node 0's container is the restart's, of one node; host 1 keeps the first start's (ended with its daemon)
    assert restart_container(c, job, job_id, 0)["ddp-cifar.nnodes"] == "1"
