"""The progress line under `up` shows the attempt it watches: a second `up` of a job name (`up --resume`) starts
with the previous run's `done` heartbeat in the checkpoint folder, and must not show it as its own progress.

On two stock test hosts (sshd + dockerd + torchrun, CPU image). Without a terminal, `up` prints a progress line
at the first beat it shows, then every 30 s, and the `done` one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kit.orchestrate_kit import Data, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

PROGRESS = re.compile(r"^progress: step (\d+)/(\d+) ")


def totals(out: str) -> list[int]:
    """The total steps of every progress line, in order."""
    return [int(m.group(2)) for m in map(PROGRESS.match, out.splitlines()) if m]


def test_up_resume_never_shows_the_previous_runs_done_beat(target: Cluster, work: Path, data: Data,
                                                            hosts: Path) -> None:
    state = work / "state"
    first = orchestrate(target, state, *up_args(hosts, data, "again", trainer=("--epochs", "1")))
    assert first.returncode == 0
    first_total = totals(first.stdout)[-1]
    resumed = orchestrate(target, state, *up_args(hosts, data, "again", "--resume", trainer=("--epochs", "2")))
    assert resumed.returncode == 0
    shown = totals(resumed.stdout)
    # Every line is the new run's (its total is two epochs' steps), the first of them printed only after its
    # first beat: the old run's `step N/N (100%) ... done` never appears.
    assert shown and set(shown) == {2 * first_total}, shown
