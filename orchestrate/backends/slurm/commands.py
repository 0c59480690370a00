"""The thin I/O of the Slurm allocator: Slurm's clients (scontrol, sbatch, squeue, scancel) run here and nowhere
else; what they print is read by records.py, what they are given is made by script.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from orchestrate.backends.slurm import records, script
from orchestrate.errors import ConfigError
from orchestrate.localfs import write_atomically

TIMEOUT_S = 60  # a controller that does not answer in a minute is down; Slurm's own clients retry inside it


def run(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A Slurm client's stdout (`env`: variables added to this process's environment for it); missing client or a
    refusal → ConfigError with Slurm's own line."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                             env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise ConfigError(f"{argv[0]} not found: Slurm's clients are not installed here; run this where they are "
                          "(a login or compute node of the Slurm cluster)") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{argv[0]} got no answer from Slurm's controller in {TIMEOUT_S} s; is slurmctld "
                          "up (scontrol ping)?") from None
    if res.returncode != 0:
        raise ConfigError(script.refusal(argv, res.stderr))
    return res.stdout


def allocation_id(given: str | None = None) -> str:
    """The allocation this runs in: SLURM_JOB_ID (set by sbatch, salloc and srun)."""
    job_id = given or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError("--hosts slurm: SLURM_JOB_ID is not set, so this runs in no Slurm allocation; run it "
                          "inside one (salloc -N 2, or 'submit'), or give --hosts FILE")
    return job_id


def allocation_hosts_file(folder: Path) -> tuple[Path, int]:
    """The allocation's nodes as a hosts file (node 0 first, each with the GPUs Slurm granted there) in folder,
    and the GPUs per node (0: none granted)."""
    job_id = allocation_id()
    record = records.parse_job(run(["scontrol", "show", "job", "-d", job_id]))
    nodes = run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST") or record.node_list]).split()
    text, per_node = records.hosts_text(job_id, nodes, record.gpus)
    path = allocation_file(folder, job_id)
    write_atomically(path, [text.encode()])
    return path, per_node


def allocation_file(folder: Path, job_id: str) -> Path:
    """Where allocation_hosts_file writes the hosts file of Slurm job `job_id`."""
    return folder / f"slurm-{job_id}.hosts"


def record_submitted(folder: Path, job: str, job_id: str) -> None:
    """What `submit` leaves here: this job name went to Slurm (as job `job_id`, the newest)."""
    write_atomically(submitted_file(folder, job), [f"{job_id}\n".encode()])


def submitted_file(folder: Path, job: str) -> Path:
    return folder / f"{job}.slurm"


def find_submitted(name: str, user: str, folder: Path) -> list[records.JobRecord]:
    """find_jobs for a job name that `submit` sent from here; [] without asking Slurm for any other (status and
    kill of a job run on a hosts file must not wait on a controller, wherever Slurm's clients are installed)."""
    return find_jobs(name, user) if submitted_file(folder, name).is_file() else []


def find_jobs(name: str, user: str) -> list[records.JobRecord]:
    """Every job of this name and user that the controller still knows (pending, running, or ended within
    MinJobAge), newest last; [] where Slurm is not installed."""
    try:
        text = run(["scontrol", "show", "job", "-d"])
    except ConfigError:
        return []
    return [r for r in records.parse_jobs(text) if r.name == name and r.user == user]


def kill_wait() -> int | None:
    """Slurm's KillWait; None where it cannot be read (then sbatch's own error says why)."""
    try:
        return records.kill_wait(run(["scontrol", "show", "config"]))
    except ConfigError:
        return None


def queued(name: str, user: str) -> list[records.JobRecord]:
    return [r for r in find_jobs(name, user) if r.state in records.ACTIVE]


def sbatch(argv: list[str], env: dict[str, str]) -> str:
    """sbatch → Slurm's job id."""
    return run(argv, env).strip().split(";", 1)[0]


def cancel(job_ids: list[str]) -> None:
    run(["scancel", *job_ids])


def submit_job(s: script.Submission, user: str) -> str:
    """sbatch the job unless this user has one of its name queued or running, or its stop would outlast
    Slurm's KillWait; Slurm's job id."""
    problem = script.grace_problem(s.stop_grace, kill_wait())
    if problem:
        raise ConfigError(problem)
    clash = queued(s.job, user)
    if clash:
        raise ConfigError(f"job {s.job!r} is already queued or running under Slurm (job "
                          f"{', '.join(r.job_id for r in clash)}, {clash[-1].describe()}); 'kill --job {s.job}' "
                          "first, or choose another --job")
    return sbatch(script.sbatch_argv(s), dict(s.secret_env))
