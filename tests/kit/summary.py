"""The one-screen summary at the end of a test run: tests and test-seconds per tier, the wall clock, the slowest.

CI's budget (20 minutes from a fresh clone, docs/benchmarks.md) is spent here, so the end of every run says where:
the tiers are the kinds of real part a test needs (none, torch's process groups, simulated hosts, Slurm on them, the
Docker image), and a test's seconds are its setup, call and teardown together (a module fixture that makes a cluster
is paid by the module's first test). Under pytest-xdist the controller receives every worker's reports, so the tier
sums add up the workers' time: more than the wall clock by about the number of workers.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TIERS = ("unit", "trainer", "image", "cluster", "slurm")
SLOWEST_SHOWN = 10


def tier_of(nodeid: str) -> str:
    """The tier of a test, from where it lives: tests/trainer, tests/image, tests/cluster (its Slurm modules apart),
    everything else is a unit test (tests/orchestrate and the top-level modules need no real part but files)."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/cluster/"):
        return "slurm" if "slurm" in path.rsplit("/", 1)[-1] else "cluster"
    for tier in ("trainer", "image"):
        if path.startswith(f"tests/{tier}/"):
            return tier
    return "unit"


@dataclass(eq=False)  # a plugin object: pluggy keeps it in a set, so it must hash by identity
class RunSummary:
    """Collects each test's seconds as the reports arrive; prints the table once the run ends."""

    store: Path | None = None  # where to write each unit's seconds (JSON), for the scheduler's next run
    unit_of: Callable[[str], str] = lambda nodeid: nodeid.split("::", 1)[0]  # a test's unit of work: its module
    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def lines(self) -> list[str]:
        count: dict[str, int] = defaultdict(int)
        spent: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            count[tier_of(nodeid)] += 1
            spent[tier_of(nodeid)] += seconds
        wall = time.monotonic() - self.started
        out = [f"{'tier':<8} {'tests':>6} {'test-seconds':>13} {'share':>6}"]
        total = sum(spent.values()) or 1.0
        for tier in TIERS:
            out.append(f"{tier:<8} {count[tier]:>6} {spent[tier]:>13.0f} {spent[tier] / total:>6.0%}")
        out.append(f"{'all':<8} {sum(count.values()):>6} {sum(spent.values()):>13.0f}   wall clock {wall:.0f} s")
        out.append(f"the {SLOWEST_SHOWN} slowest (seconds, setup + call + teardown):")
        slowest = sorted(self.seconds.items(), key=lambda item: item[1], reverse=True)[:SLOWEST_SHOWN]
        out += [f"{seconds:8.1f}  {tier_of(nodeid):<7}  {nodeid}" for nodeid, seconds in slowest]
        return out

    @pytest.hookimpl(trylast=True)  # the last section, just above pytest's own closing lines
    def per_unit(self) -> dict[str, float]:
        units: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            units[self.unit_of(nodeid)] += seconds
        return {unit: round(seconds, 1) for unit, seconds in sorted(units.items())}

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds:
            return
        if self.store is not None:
            self.store.write_text(json.dumps(self.per_unit(), indent=1) + "\n")
        terminalreporter.section("where the time went (tests/kit/summary.py)")
        for line in self.lines():
            terminalreporter.write_line(line)
