"""`up` on hosts as they come (issue "Real hosts as they come"): OpenSSH's stock limits (10 channels per
connection), a non-root login in the docker group, three hosts, one without the SFTP subsystem, and traps another
account could set: a folder of the chain that is not ours, a symlink planted where a temporary file used to go.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.orchestrate_kit import (
    PATIENCE,
    Data,
    bounded,
    data_dir,
    default_dirs,
    job_containers,
    job_dir,
    kill_process_group,
    manifests,
    orchestrate,
    start,
    up_args,
    wait_for,
)

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
STATUS_RUNS = 2
TRAINING = re.compile(r"^progress: step [1-9]", re.MULTILINE)  # rank 0's heartbeat, as `status` shows it


@pytest.fixture(scope="module")
def target(cluster_factory) -> Cluster:  # type: ignore[no-untyped-def]
    """Three hosts; host 2 has no SFTP subsystem; all log in as the non-root user."""
    return cluster_factory(3, no_sftp=[2])


@pytest.fixture
def planted(target: Cluster) -> Iterator[tuple[Path, Path]]:
    """A file of the user's, and a symlink to it where the archive's temporary name used to be (`.part`)."""
    h = target.hosts[2]  # the host without SFTP: the archive is written through an exec channel
    victim = h.path(f"{h.home}/precious.txt")
    h.run(["sh", "-c", 'printf keep > "$0"', f"{h.home}/precious.txt"], user=target.user)
    data = f"{h.home}/.cache/ddp-cifar/data"
    h.run(["mkdir", "-p", data], user=target.user)
    h.run(["ln", "-sf", f"{h.home}/precious.txt", f"{data}/cifar-10-python.tar.gz.part"], user=target.user)
    yield victim, h.path(f"{data}/cifar-10-python.tar.gz.part")


def test_trains_to_the_end_without_sftp_with_status_and_logs_beside(
        target: Cluster, work: Path, data: Data, hosts: Path, planted: tuple[Path, Path]) -> None:
    state, job = work / "state", "stock"
    # The archive is sent from here to every node (file writes without SFTP on host 2: --relay off, else host 2
    # would fetch it from node 0), 2 processes per node, and enough epochs
    # that `status` sees the job train STATUS_RUNS times beside the attached `up` (30 epochs trained for 5 s, a
    # `status` took 0.7 s; both slow down alike on a loaded machine), with `logs -f` following the job to its end.
    up = start(target, state, *up_args(hosts, data, job, "--nproc-per-node", "2", "--data-from", str(data.archive),
                                       "--relay", "off", "--timings", trainer=("--epochs", "30"), one_thread=False))
    follow = None
    try:
        wait_for(lambda: len([c for _, c in job_containers(target, job) if c.status == "running"])
                 == len(target.hosts), PATIENCE, "the job's containers to run")
        follow = start(target, state, "logs", "-f", "--job", job)
        polls, trained = 0, 0
        while up.poll() is None and trained < STATUS_RUNS and polls < 200:  # bounded: the job may still start
            status = orchestrate(target, state, "status", "--job", job)
            assert status.returncode == 0, status.stderr
            polls += 1
            trained += bool(TRAINING.search(status.stdout))
        out, _ = up.communicate(timeout=bounded(PATIENCE))
        followed, _ = follow.communicate(timeout=bounded(120))
    finally:
        kill_process_group(up, signal.SIGKILL)
        if follow is not None:
            kill_process_group(follow, signal.SIGKILL)
    print(out)
    assert up.returncode == 0, out
    print(f"status ran {polls} times beside the job, {trained} of them while it trained")
    assert trained == STATUS_RUNS, f"the job ended after {trained} `status` runs saw it train: train it longer"
    assert "finished: epochs=30" in out and "world_size=6" in out
    assert "unreachable" not in out and "ChannelException" not in out
    # Node 2's ranks log nothing of their own (rank 0 logs): torchrun's OMP_NUM_THREADS warning is its line here.
    assert follow.returncode == 0 and "[node 2] " in followed
    # Within OpenSSH's default of 10 channels per connection, whatever ran beside.
    peak = dict(re.findall(r"(\S+) (\d+)", out.split("peak SSH channels per host:", 1)[1].splitlines()[0]))
    assert set(peak) == {h.name for h in target.hosts} and all(1 <= int(n) <= 10 for n in peak.values()), peak

    killed = orchestrate(target, state, "kill", "--job", job)
    assert killed.returncode == 0 and job_containers(target, job) == []
    # Everything the job and the data fetch wrote belongs to the login user, on both hosts.
    assert manifests(job_dir(target, 0, job))  # rank 0 writes the checkpoints
    for i, h in enumerate(target.hosts):
        assert list(data_dir(target, i).iterdir()) and list(job_dir(target, i, job, "logs").iterdir())
        for folder in default_dirs(target, i, job).values():
            assert h.path(folder).is_dir() and h.foreign_files(folder) == [], folder
    # The symlink planted at the old temporary name was not followed: its target is unchanged.
    victim, link = planted
    assert victim.read_text() == "keep" and link.is_symlink()


def test_a_dir_of_another_account_in_the_chain_is_refused(target: Cluster, work: Path, data: Data,
                                                          tmp_path: Path) -> None:
    h = target.hosts[0]
    folder = f"/var/tmp/ddp-cifar-{tmp_path.name}"  # made first by another account, as on a shared machine
    h.run(["mkdir", "-m", "1777", folder], user="nobody")
    hosts = target.write_hosts_file(tmp_path / "hosts.txt", keys={0: {"data_dir": f"{folder}/data"}})
    res = orchestrate(target, work / "state", *up_args(hosts, data, "foreign"))
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.strip().splitlines() if h.name in ln]
    assert len(lines) == 1 and f"{folder} (owned by nobody) belongs to another account" in lines[0], res.stderr
    assert job_containers(target, "foreign") == []
    assert not h.path(f"{folder}/data").exists()  # nothing was created in it
