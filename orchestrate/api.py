"""The Python API; the command line is a thin layer over it (`python -m orchestrate ...` parses its arguments into
the same frozen, validated configs and calls these functions).

    from orchestrate import Job, up, kill, status

    job = Job("hosts.txt", job="r18", gpus=8, max_restarts=3, trainer_args=("--epochs", "30"))
    up(job)                    # 0 when the training finished; raises OrchestrateError (one line) when not
    status("r18")              # the hosts of the job's last up are remembered
    kill("r18")

Expected failures raise OrchestrateError subclasses (ConfigError, PreflightError, JobError, MultiHostError), each
with the one-line message the command line prints and its `exit_code`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrate.config import JobsConfig, SSHOptions, UpConfig
from orchestrate.gpuspec import split
from orchestrate.terminal import console_for


def Job(hosts: str | Path, *, ssh_config: str | Path | None = None, accept_new_host_keys: bool = False,  # noqa: N802
        **options: Any) -> UpConfig:
    """An `up` configuration: `hosts` is the hosts file; `options` are `up`'s long options with underscores
    (job, image, entry, gpus as an int (-1: all) or device indices (4, 5, 6, 7), env as ((NAME, VALUE), ...),
    trainer_args: the program's arguments, ...). Validated at once: a bad value raises ConfigError naming the
    option."""
    ssh = SSHOptions(Path(hosts), Path(ssh_config) if ssh_config else None, accept_new_host_keys)
    if not isinstance(options.get("gpus", 0), int):  # device indices, as `--gpus 4-7`
        options = {**options, **dict(zip(("gpus", "gpu_ids"), split(options["gpus"]), strict=True))}
    return UpConfig.of(ssh, **options)


# Each command's scheduler is chosen here, where the command is composed (the registered default: Docker over SSH),
# and passed down: nothing below looks one up (lint contract backend-given).


def up(job: UpConfig, console: Console | None = None) -> int:
    from orchestrate.backends.choice import scheduler
    from orchestrate.pipeline import up as run_up

    return run_up(job, console or console_for(), scheduler())


def check(job: UpConfig, console: Console | None = None) -> int:
    """The network check with the job's settings (`check`); 1 when a node is an outlier."""
    from orchestrate.backends.choice import scheduler
    from orchestrate.pipeline import check as run_check

    return run_check(job, console or console_for(), scheduler())


def kill(name: str, hosts: str | Path | None = None, grace: float = 60.0, console: Console | None = None) -> int:
    return _jobs("kill", JobsConfig(ssh=_ssh(hosts), job=name, grace=grace), console)


def status(name: str, hosts: str | Path | None = None, console: Console | None = None) -> int:
    return _jobs("status", JobsConfig(ssh=_ssh(hosts), job=name), console)


def logs(name: str, hosts: str | Path | None = None, node: int | None = None, tail: int = 100,
         console: Console | None = None) -> int:
    return _jobs("logs", JobsConfig(ssh=_ssh(hosts), job=name, node=node, tail=tail), console)


def plot(name: str, out: str | Path | None = None, hosts: str | Path | None = None,
         console: Console | None = None) -> int:
    return _jobs("plot", JobsConfig(ssh=_ssh(hosts), job=name, out=Path(out) if out else None), console)


def _ssh(hosts: str | Path | None) -> SSHOptions:
    return SSHOptions(Path(hosts) if hosts else None, None, False)


def jobs(command: str, config: JobsConfig, console: Console | None = None) -> int:
    """kill / status / logs / plot / tensorboard from a JobsConfig (what the command line builds)."""
    return _jobs(command, config, console)


def _jobs(command: str, config: JobsConfig, console: Console | None) -> int:
    from orchestrate.backends.allocators import ALLOCATORS
    from orchestrate.backends.choice import scheduler
    from orchestrate.jobs.commands import run_jobs_command

    return run_jobs_command(command, config, console or console_for(), scheduler(), ALLOCATORS)
