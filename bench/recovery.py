"""How fast a job heals, and how long the cluster-wide commands take, on real test hosts: the figures
docs/what-happens-when.md and docs/orchestrate.md quote, each beside its baseline and its bound.

    sudo .venv/bin/python bench/recovery.py [--only cut|kill|stall|host|check|sixteen]

The scenarios are the cluster tests themselves (real sshd, dockerd, torchrun; tests/cluster/): each asserts what
happens, and prints when it happened. This runs them (pytest -s, one at a time, serially) and reads those lines,
so the figures come from the very runs that prove the behaviour. Needs root, the local dockerd and the CPU image,
as `make test` does; about 10 minutes for all on 2 cores. Exits 1 when a figure is past its bound
(bench/bounds.py), or when a scenario's test fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

HEAL = "tests/cluster/test_self_healing.py::"


@dataclass(frozen=True)
class Measure:
    """A figure a test prints: `pattern`'s first group, in seconds."""

    name: str
    pattern: str
    baseline: str
    bound: float


# What each scenario's test prints, and the bounds: the backoff (10 s) and `docker stop`'s grace (10 s) are
# inside every "training again"; a host counts as down after 15 s without an answer.
SCENARIOS: dict[str, tuple[str, list[Measure]]] = {
    "kill": (HEAL + "test_a_killed_container_is_restarted_and_the_run_ends_as_an_uninterrupted_one", [
        Measure("killed container: death seen", r"killed container: detected after ([\d.]+) s",
                "Docker's wait answers at once", 5),
        Measure("killed container: training again", r"killed container: .*training again after ([\d.]+) s",
                "10 s of it the restart backoff", 45)]),
    "stall": (HEAL + "test_a_rank_stopped_as_training_starts_is_found_as_a_stall_and_the_job_starts_over", [
        Measure("stalled rank: found", r"stall detected ([\d.]+) s after SIGSTOP", "--stall-timeout 15 s", 30),
        Measure("stalled rank: training again", r"stalled rank: training again ([\d.]+) s",
                "10 s dump wait + 10 s SIGKILL grace + 10 s backoff", 90)]),
    "cut": (HEAL + "test_node_0s_host_cut_off_the_job_finishes_on_the_others_from_the_replica", [
        Measure("host cut off: found", r"host cut off: detected after ([\d.]+) s", "15 s without an answer", 45),
        Measure("host cut off: training again on the others", r"training again on 2 nodes after ([\d.]+) s",
                "109-144 s while each step waited out SSH timeouts to the lost host", 109)]),
    "host": ("tests/cluster/test_host_faults.py::"
             "test_a_daemon_restart_then_a_reboot_under_the_job_are_named_and_the_job_continues", [
        Measure("daemon restart: training again", r"daemon restart: [^;]*training again after ([\d.]+) s",
                "10 s of it the restart backoff", 60),
        Measure("reboot: training again", r"reboot: .*training again after ([\d.]+) s",
                "20 s of it the restart backoff", 90)]),
    "check": ("tests/cluster/test_network_check.py::test_the_slow_host_is_the_outlier_and_the_equal_ones_are_not", [
        Measure("`check` on 3 hosts (one link slowed)", r"check on 3 hosts, node 2 at 30 Mbit/s, took ([\d.]+) s",
                "the self-test and 16 MB within and across 3 hosts", 120)]),
    "sixteen": ("tests/cluster/test_sixteen_hosts.py::"
                "test_sixteen_hosts_train_a_killed_node_is_restarted_on_all_and_kill_stops_every_host", [
        Measure("16 hosts: attached `up` until 2 checkpoints", r"16 hosts x 1 process: attached up training \(2 checkpoints\) "
                r"after ([\d.]+) s", "8 hosts, attached `up` of 1 epoch: 24 s", 120),
        Measure("16 hosts: node 9 killed, training again on 16", r"training again on 16 after ([\d.]+) s",
                "2 hosts: 21.1 s (10 s backoff then, 1 s here)", 120),
        Measure("16 hosts: `kill --job`", r"kill --job on 16 hosts took ([\d.]+) s", "--grace 5", 30)]),
}


def run(test: str) -> tuple[int, str]:
    """The test's exit code and what it printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", test], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n", 1)[0])
    p.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    args = p.parse_args()
    figures, failed = [], []
    for key in args.only:
        test, measures = SCENARIOS[key]
        code, out = run(test)
        if code != 0:
            failed.append(f"{test}: exit {code}\n{out[-3000:]}")
            continue
        for m in measures:
            found = re.search(m.pattern, out)
            if found is None:
                failed.append(f"{test}: no line matching {m.pattern!r}")
                continue
            figures.append(Figure(m.name, float(found[1]), "s", m.baseline, m.bound, False))
            print(figures[-1].line(), flush=True)
    for line in failed:
        print(f"error: {line}")
    return finish(figures) or int(bool(failed))


if __name__ == "__main__":
    sys.exit(main())
