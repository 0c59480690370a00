"""Helpers for the tests on a real Slurm (devcluster --slurm): the orchestrator installed where every host sees it,
`submit` of a short CPU training, and waits on the batch output and on Slurm's record of the job.

The batch job runs as root on the first host, in that host's mount namespace: the machine's /root (where this
Python lives) and /tmp (where a fresh clone may be) are not there, so the orchestrator is installed into the
cluster's folder, which every host sees, as a site installs it on shared storage (kit/shared_install.py), and the
batch job runs the system's python3 on it; its state and working folder are there too (docs/slurm.md: "The test
cluster").
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from devcluster import Cluster
from kit.orchestrate_kit import IMAGE, REPO, SHARED_CORES, TRAIN, Data, orch_env, run_to_end, wait_for
from kit.shared_install import install, pythonpath

SYSTEM_PYTHON = "/usr/bin/python3"  # python3.11 as the venv's: its compiled packages load
SHARED = "shared-software"  # under the cluster's folder
# How long Slurm may take to record a job's end once nothing of ours runs: its steps get SIGTERM, then SIGKILL after
# KillWait (30 s), a step whose processes outlive that is waited for up to UnkillableStepTimeout (60 s), and each
# node's reply may take MessageTimeout (10 s); Slurm's defaults, with room for a loaded machine.
SLURM_BOOKKEEPING_S = 150


@contextmanager
def slurm_cluster() -> Iterator[Cluster]:
    """2 hosts with a real Slurm and 2 simulated GPUs each, every host holding the test image, and the orchestrator
    installed for it."""
    with Cluster.create(2, gpus=2, slurm=True, images=(IMAGE,)) as c:
        install(REPO, c.dir / SHARED)
        yield c


def env(c: Cluster) -> dict[str, str]:
    """The orchestrator's environment, as sbatch passes it on to the batch job: state under the cluster's folder
    (the same on the first host), and the orchestrator installed where every host sees it."""
    return {**orch_env(c, c.dir / "orch-state"), "PYTHONPATH": pythonpath(c.dir / SHARED)}


def orchestrate(c: Cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    res = run_to_end(list(args), env(c), timeout)
    print(f"$ orchestrate {' '.join(args)}\n--- rc={res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def submit(c: Cluster, data: Data, job: str, *extra: str, epochs: int, image: str = IMAGE,
           trainer: tuple[str, ...] = ()) -> str:
    """`submit` of a short CPU training of 2 nodes with 1 granted GPU each; Slurm's job id. One intra-op thread a
    rank (SHARED_CORES, as `up_args` gives the other cluster tests): torchrun sets it only for several processes a
    node, and a rank's second OpenMP thread spins against the other tests' for nothing here."""
    res = orchestrate(c, "submit", "--nodes", "2", "--gpus-per-node", "1", "--python", SYSTEM_PYTHON,
                      "--output", f"{c.dir}/slurm-%j.out", "--job", job, "--image", image,
                      "--data-url", data.url, "--data-md5", data.md5, *SHARED_CORES, *extra,
                      "--", *TRAIN, "--epochs", str(epochs), "--log-every", "1", *trainer)
    assert res.returncode == 0 and re.fullmatch(r"\d+\n", res.stdout), res.stderr
    return res.stdout.strip()


def batch_output(c: Cluster, job_id: str) -> str:
    """The batch job's output so far ('' before Slurm has made the file)."""
    out = c.dir / f"slurm-{job_id}.out"
    return out.read_text(errors="replace") if out.exists() else ""


def slurm_state(c: Cluster, job_id: str) -> tuple[str, str]:
    """Slurm's JobState and ExitCode of the job."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                         env=c.client_env(), cwd="/", check=True).stdout
    state, code = re.search(r"JobState=(\S+)", out), re.search(r"ExitCode=(\S+)", out)
    return (state.group(1) if state else "", code.group(1) if code else "")


def slurm_story(c: Cluster, job_id: str) -> str:
    """What a failed wait for Slurm leaves to read: the job's record, the tails of slurmctld's and each slurmd's
    logs, and the processes of the job's steps (the hosts share the machine's pid namespace)."""
    record = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                            env=c.client_env(), cwd="/").stdout
    logs = [c.dir / "slurm" / "slurmctld.log", *sorted((c.dir / "slurm").glob("*/slurmd.log"))]
    tails = [f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
             for log in logs if log.exists()]
    steps = subprocess.run(["ps", "-eo", "pid,ppid,stat,etimes,args", "--forest"], capture_output=True, text=True,
                           timeout=30).stdout
    tree = [line for line in steps.splitlines() if re.search(r"slurmstepd|guard\.sh|slurm_script|orchestrate|srun|"
                                                              r"docker (kill|inspect|ps|exec)|sleep 3600", line)]
    return "\n".join([record, *tails, "--- step processes", *tree])


def wait_for_end(c: Cluster, job_id: str, within: float = SLURM_BOOKKEEPING_S) -> None:
    """Until Slurm's job `job_id` is neither running nor completing; on a timeout, the story of why not."""
    started = time.monotonic()
    try:
        wait_for(lambda: slurm_state(c, job_id)[0] not in ("RUNNING", "COMPLETING"), within,
                 "Slurm to record the job's end")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{slurm_story(c, job_id)}") from None
    print(f"Slurm recorded job {job_id}'s end {time.monotonic() - started:.1f} s after our side had ended")
