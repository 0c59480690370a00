"""`python -m orchestrate submit`: the job queued with sbatch; its batch script runs `up --hosts slurm` on the
allocation's first node. Its own options are Submission's fields (script.py); up's are read by the command line's
`up` parser, so a typo fails now and not in the queue."""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from orchestrate.backends.protocol import CommandLine
from orchestrate.backends.slurm import commands, script
from orchestrate.errors import ConfigError

HOSTS = Path("slurm")  # --hosts slurm: the allocation's nodes
DESCRIPTION = ("Queue the job with Slurm (sbatch) and return: the batch script runs 'up --hosts slurm' on the "
               "allocation's first node. Any option of up goes here too; trainer options after '--'. docs/slurm.md")


def parser(line: CommandLine) -> argparse.ArgumentParser:
    return line.parser("submit", DESCRIPTION, script.Submission)


def submission(argv: Sequence[str], trainer: Sequence[str], line: CommandLine) -> script.Submission:
    """submit's own options, and up's (checked as up checks them)."""
    ns, up_args = parser(line).parse_known_args(argv)
    up_ns = line.up_options(up_args)
    if up_ns.hosts is not None:
        raise ConfigError("submit: the hosts are the allocation's (--hosts slurm); leave --hosts out")
    if up_ns.detach:
        raise ConfigError("submit: --detach would end the Slurm job while its containers run on outside it; "
                          "leave it out (submit itself returns at once)")
    if ns.nodes < 1:
        raise ConfigError(f"--nodes {ns.nodes}: ask for at least 1")
    too_short = script.time_problem(ns.time, ns.stop_grace)
    if too_short:
        raise ConfigError(too_short)
    job = line.up_config(up_ns, HOSTS, trainer).program.job
    return script.Submission(job=job, up_args=tuple(up_args), trainer_args=tuple(trainer), **vars(ns))


def run(argv: Sequence[str], trainer: Sequence[str], line: CommandLine, console: Console) -> int:
    sub = submission(argv, trainer, line)
    if sub.dry_run:
        console.print(script.dry_run_text(sub), markup=False, end="", soft_wrap=True)
        return 0
    console.print(commands.submit_job(sub, getpass.getuser()), markup=False)
    return 0
