"""`status --job` and `kill --job` on Slurm's side: the Slurm job of that name and user, beside our containers."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

from rich.console import Console

from orchestrate.backends.slurm import commands, records


def describe(job: str, console: Console, folder: Path) -> bool:
    """status: print the state of this user's newest Slurm job of the name. True when Slurm knows the job (our side
    may then have nothing yet: a pending job has no containers). Slurm is asked only about a job `submit` sent from
    here (its record in `folder`)."""
    found = commands.find_submitted(job, getpass.getuser(), folder)
    if found:
        console.print(f"slurm: job {found[-1].job_id} {found[-1].describe()}", markup=False, highlight=False)
    return bool(found)


def cancel(job: str, console: Console, folder: Path) -> bool:
    """kill: scancel this user's Slurm jobs of the name that are queued or running, except the allocation this runs
    in (the batch script's own stop must not cancel itself). True when Slurm knows the job; only a job `submit` sent
    from here (its record in `folder`) is asked about."""
    found = commands.find_submitted(job, getpass.getuser(), folder)
    active = [r for r in found if r.state in records.ACTIVE and r.job_id != os.environ.get("SLURM_JOB_ID")]
    if active:
        commands.cancel([r.job_id for r in active])
        for r in active:
            console.print(f"slurm: cancelled job {r.job_id} (was {r.describe()})", markup=False, highlight=False)
    return bool(found)
