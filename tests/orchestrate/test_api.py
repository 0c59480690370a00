"""The Python API: the same validated configs and functions as the command line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

import orchestrate
from orchestrate import Job, up
from orchestrate.errors import ConfigError


def test_a_job_is_validated_when_made_and_its_dry_run_prints_the_plan(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("10.0.0.11 slots=2\n10.0.0.12 slots=2\n")
    with pytest.raises(ConfigError, match="--max-restarts 1000 must be between 0 and 100"):
        Job(hosts, job="r18", max_restarts=1000)
    job = Job(hosts, job="r18", gpus=0, dry_run=True, max_restarts=2, trainer_args=("--epochs", "3"))
    out = io.StringIO()
    assert up(job, Console(file=out, width=400)) == 0
    plan = out.getvalue()
    assert "# node 1 on 10.0.0.12" in plan and "--name r18-node0" in plan and "--epochs 3" in plan
    assert {"Job", "up", "kill", "status", "logs", "plot", "check"} <= set(orchestrate.__all__)
