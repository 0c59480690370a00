"""The safety net of tests/cluster/conftest.py (`_leave_nothing_running`) run for real, in CI: a pytest session in a
subprocess runs tests/cluster/deliberate_failure.py, whose first test fails on purpose while its `up` and the job's
containers run; its second test passes only if the net ended both. Without the net a failed cluster test leaves its
job running, and every later `up` on those hosts is refused (master port in use)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kit.orchestrate_kit import PATIENCE

REPO = Path(__file__).resolve().parents[2]


def test_a_failed_cluster_test_leaves_neither_its_up_nor_its_job_running() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/cluster/deliberate_failure.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=PATIENCE, env={**os.environ, "PYTHONPATH": str(REPO)})
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 1 and "1 failed, 1 passed" in summary, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "deliberate failure, with the job running" in proc.stdout
