"""Test-only gates: a point in `up` where a test holds it, so that a race the test forces lands every time, not
by luck. Each gate is an environment variable naming a file; unset (always, outside the tests) it costs one
lookup."""

from __future__ import annotations

import os
import time

GATE_WAIT_S = 300  # the longest a gate holds: a test that never opens it still ends, below pytest's timeout

# A restart stops between the backoff's last look and the start of its containers
# (tests/cluster/test_orchestrate_faults.py lands a kill there).
RESTART_GATE_ENV = "DDP_CIFAR_TEST_RESTART_GATE"
# A first claim stops between the GPU-set choice (preflight) and the creation of its containers
# (tests/cluster/test_gpu_sets.py lets another `up` claim the same GPUs there).
CLAIM_GATE_ENV = "DDP_CIFAR_TEST_CLAIM_GATE"


def hold_at(env: str) -> None:
    """With env=PATH, create PATH.reached, then wait (at most GATE_WAIT_S) until PATH exists."""
    gate = os.environ.get(env)
    if not gate:
        return
    open(f"{gate}.reached", "w").close()
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.1)
