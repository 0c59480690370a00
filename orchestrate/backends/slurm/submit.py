"""`python -m orchestrate submit`: the job queued with sbatch; its batch script runs `up --hosts slurm` on the
allocation's first node. Its own options are Submission's fields (script.py); up's are read by the command line's
`up` parser, so a typo fails now and not in the queue."""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from orchestrate.backends.docker_ssh import carried
from orchestrate.backends.docker_ssh.layercache import registry_binary
from orchestrate.backends.protocol import CommandLine
from orchestrate.backends.slurm import commands, script
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError
from orchestrate.localfs import state_root

HOSTS = Path("slurm")  # --hosts slurm: the allocation's nodes
DESCRIPTION = ("Queue the job with Slurm (sbatch) and return: the batch script runs 'up --hosts slurm' on the "
               "allocation's first node. Any option of up goes here too; trainer options after '--'. docs/slurm.md")


def parser(line: CommandLine) -> argparse.ArgumentParser:
    return line.parser("submit", DESCRIPTION, script.Submission)


def submission(argv: Sequence[str], trainer: Sequence[str], line: CommandLine) -> tuple[script.Submission, UpConfig]:
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
    up = line.up_config(up_ns, HOSTS, trainer)
    return script.Submission(job=up.program.job, up_args=tuple(up_args), trainer_args=tuple(trainer), **vars(ns)), up


def run(argv: Sequence[str], trainer: Sequence[str], line: CommandLine, console: Console) -> int:
    sub, up = submission(argv, trainer, line)
    image = up.program.image
    # The image built here, unless the nodes pull it: carried to them through the shared storage (carried.py).
    image_id = None if up.delivery.pull else carried.local_image_id(image)
    store = (sub.layer_store or state_root() / "images").absolute()  # the batch job may run in another folder
    if image_id is not None:
        refused = carried.refusal(up.delivery.layer_cache, registry_binary() is not None)
        if refused:
            raise ConfigError(refused)
        sub = replace(sub, up_args=(*sub.up_args, "--image-from", str(carried.manifest_path(store, image_id))))
    if sub.dry_run:
        console.print(carried.dry_run_line(image, image_id, store), markup=False, soft_wrap=True)
        console.print(script.dry_run_text(sub), markup=False, end="", soft_wrap=True)
        return 0
    if image_id is not None:  # before sbatch: the job may start at once; its lines on stderr, the job ID alone on stdout
        carried.write(image, image_id, store, Console(stderr=True))
    console.print(commands.submit_job(sub, getpass.getuser()), markup=False)
    return 0
