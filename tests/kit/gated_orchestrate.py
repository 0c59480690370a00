"""`python -m kit.gated_orchestrate ARGS` (tests/ on PYTHONPATH): orchestrate's CLI with file gates installed as its
Pauses (orchestrate/pauses.py), so that a test lands a race on the very moment it names, every time.

The kit starts every orchestrator process through this module (orchestrate_kit.spawn). A gate is an environment
variable of that process naming a file PATH: at its moment, `up` creates PATH.reached, then waits (at most
GATE_WAIT_S) until the test creates PATH. Unset, the gate does nothing: the run is `python -m orchestrate ARGS`.
"""

from __future__ import annotations

import os
import sys
import time

from orchestrate import pauses
from orchestrate.cli import main

GATE_WAIT_S = 300  # the longest a gate holds: a test that never opens it still ends, below pytest's timeout

# A restart holds between the backoff's last look and the start of its containers
# (tests/cluster/test_orchestrate_faults.py lands a kill there).
RESTART_GATE_ENV = "GATED_UP_RESTART_GATE"
# Each start holds between the GPU-set choice and the creation of its containers
# (tests/cluster/test_gpu_sets.py lets another `up` claim the same GPUs there).
CLAIM_GATE_ENV = "GATED_UP_CLAIM_GATE"


def hold_at(env: str) -> None:
    """With env=PATH, create PATH.reached, then wait (at most GATE_WAIT_S) until PATH exists."""
    gate = os.environ.get(env)
    if not gate:
        return
    open(f"{gate}.reached", "w").close()
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.1)


class FileGates(pauses.Pauses):
    """Each of `up`'s pauses holds at its gate file, where the test set one."""

    def before_restart_starts(self) -> None:
        hold_at(RESTART_GATE_ENV)

    def before_claim(self) -> None:
        hold_at(CLAIM_GATE_ENV)


if __name__ == "__main__":
    pauses.install(FileGates())
    sys.exit(main())
