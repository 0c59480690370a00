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
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import ConfigError
from orchestrate.localfs import state_root
from orchestrate.masking import is_secret

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
    trainer = tuple(trainer or up_ns.trainer_args)  # none given: a job file's args (the batch script passes `--`)
    config = line.up_config(up_ns, HOSTS, trainer)
    kept, secrets = _secrets_apart(up_args)
    return script.Submission(job=config.program.job, up_args=kept, trainer_args=trainer, secret_env=secrets,
                             connect_args=_connect_args(config.ssh), **vars(ns)), config


def _secrets_apart(up_args: Sequence[str]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """up's options with each secret's `--env NAME=VALUE` as `--env NAME` (the batch script's `up` reads the value
    from its environment), and those (NAME, VALUE). argparse took `--env` only whole (no abbreviations), its value
    the next argument or after `=`."""
    args, kept, secrets = list(up_args), [], []
    at = 0
    while at < len(args):
        if args[at] == "--env" and at + 1 < len(args):
            value, width = args[at + 1], 2
        elif args[at].startswith("--env="):
            value, width = args[at][len("--env="):], 1
        else:
            value, width = None, 1
        name, sep, text = (value or "").partition("=")
        if sep and is_secret(name):
            secrets.append((name, text))
            kept += ["--env", name]
        else:
            kept += args[at:at + width]
        at += width
    return tuple(kept), tuple(secrets)


def _connect_args(ssh: SSHOptions) -> tuple[str, ...]:
    """up's options that `kill` takes as well: how the nodes are reached."""
    return ((("--ssh-config", str(ssh.ssh_config)) if ssh.ssh_config else ())
            + (("--accept-new-host-keys",) if ssh.accept_new_host_keys else ()))


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
    job_id = commands.submit_job(sub, getpass.getuser())
    commands.record_submitted(line.state_dir(), sub.job, job_id)
    console.print(job_id, markup=False)
    return 0
