"""By hand only, never in CI (the file name is not test_*.py, so pytest collects it only when named):

    DDP_TEST_IMAGE=ddp-cifar:cpu .venv/bin/python -m pytest tests/cluster/deliberate_failure.py

The first test fails on purpose while its `up` and the job's containers run; the second, run after it on the same
hosts, passes only when tests/cluster/conftest.py's `_leave_nothing_running` ended both. Expected: 1 failed, 1 passed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kit.orchestrate_kit import PATIENCE, Data, job_containers, start, up_args, wait_for

from devcluster import Cluster

JOB = "deliberate"
left: list[subprocess.Popen[str]] = []  # the first test's `up`, for the second to look at


def test_fails_with_its_up_and_job_running(target: Cluster, work: Path, data: Data, hosts: Path, cpu_image: str) -> None:
    left.append(start(target, work / "state", *up_args(hosts, data, JOB, trainer=("--epochs", "200"))))
    wait_for(lambda: len([c for _, c in job_containers(target, JOB) if c.status == "running"]) == len(target.hosts),
             PATIENCE, "the job's containers to run")
    raise AssertionError("deliberate failure, with the job running")


def test_the_failed_test_left_nothing_running(target: Cluster) -> None:
    assert left and left[0].poll() is not None, "the failed test's `up` still runs"
    assert job_containers(target, JOB) == [], "the failed test's job containers are still there"
