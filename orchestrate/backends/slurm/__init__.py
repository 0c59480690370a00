"""The Slurm allocator (docs/slurm.md): hosts from an allocation (`up --hosts slurm`), and a job submitted with
`sbatch` whose batch script runs `up --hosts slurm` on the allocation's first node (`submit`).

Slurm does the queueing and the sharing; the containers, the image delivery and the watch stay the Docker-over-SSH
scheduler's. `records.py` and `script.py` are pure (what Slurm printed → our types; our options → the batch script);
`commands.py` runs Slurm's clients and nothing else does; `submit.py` is the `submit` command, `control.py` Slurm's
side of `status` and `kill`. `Slurm` below is the Allocator (backends/protocol.py) registered in ALLOCATORS."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from orchestrate.backends.protocol import Allocation, Command
from orchestrate.backends.slurm import control, submit
from orchestrate.backends.slurm.commands import allocation_file, allocation_hosts_file
from orchestrate.errors import MultiHostError


class Slurm:
    """The Allocator of backends/protocol.py for Slurm (its docstrings say what each does)."""

    hosts_help = "'slurm': the nodes of the Slurm allocation this runs in"
    default_help = "slurm inside an allocation"
    examples = ("  python -m orchestrate submit --nodes 4 --gpus-per-node 8 --job r18 -- --epochs 30   # Slurm "
                "(docs/slurm.md)\n")
    epilog = ("--hosts slurm (the default inside a Slurm allocation): the allocation's nodes and the GPUs Slurm "
              "granted.\n")
    commands: Mapping[str, Command] = {"submit": submit.run}
    summaries: Mapping[str, str] = {"submit": "queue the job with Slurm (sbatch) and return; its batch script runs "
                                              "up on the allocation (docs/slurm.md)"}

    def default_hosts(self) -> Path | None:
        return submit.HOSTS if os.environ.get("SLURM_JOB_ID") else None

    def allocation(self, hosts: Path, folder: Path) -> Allocation | None:
        if hosts != submit.HOSTS:
            return None
        path, per_node = allocation_hosts_file(folder)
        return Allocation(path, per_node, "Slurm", "--gpus-per-node")

    def describe_job(self, job: str, console: Console, folder: Path) -> bool:
        return control.describe(job, console, folder)

    def cancel_job(self, job: str, console: Console, folder: Path) -> bool:
        return control.cancel(job, console, folder)

    def hint(self, err: MultiHostError, hosts_file: Path | None, folder: Path) -> MultiHostError:
        """SSH refused by nodes of the allocation this runs in: each host's line says what the site must allow."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if err.what != "ssh" or not job_id or hosts_file != allocation_file(folder, job_id):
            return err
        return MultiHostError(err.what, {host: f"{' '.join(str(why).split())}; the site must let you log in over SSH "
                                               "to the nodes of your own running job (pam_slurm_adopt)"
                                         for host, why in err.failures.items()})
