"""The rendezvous port on node 0: PURE, from the facts preflight read there.

Without `--master-port`, node 0 gets the first port from DEFAULT_PORT up that nothing listens on there and no
other job's container claims (its `ddp-cifar.master-port` label: a job still starting has a label but may not
listen yet). A restart keeps the job's own port while it is free. A port given by hand that is taken is one line
naming who holds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from orchestrate.probe.observations import Held

DEFAULT_PORT = 29500  # torchrun's own default
SEARCH = 200  # ports tried above DEFAULT_PORT before giving up: more jobs than that on one node is a mistake


def listening_ports(listening: str) -> set[int]:
    """PURE: the ports of `ss -Htln`'s local addresses (`0.0.0.0:22 [::]:2375 ...`)."""
    ports = {addr.rsplit(":", 1)[-1] for addr in listening.split()}
    return {int(p) for p in ports if p.isdigit()}


def claimed(others: Iterable[Held]) -> dict[int, str]:
    """PURE: port → the job (owner/job) whose node-0 container claims it."""
    return {h.port: h.who for h in others if h.port is not None}


def choose(given: int | None, listening: AbstractSet[int], others: Sequence[Held], keep: int | None = None,
           replaced: bool = False) -> tuple[int | None, str]:
    """PURE: (the port, the preflight cell), or (None, the problem as one line). `replaced`: the caller's own job
    of this name runs on node 0 and `--replace` removes it first, so a given port it listens on is not taken."""
    holders = claimed(others)
    if given is not None:
        if given in holders:
            return None, f"master port {given} is held by {holders[given]}; pick another with --master-port or leave it out"
        if given in listening and not replaced:
            return None, f"master port {given} already in use on node 0; pick another with --master-port or leave it out"
        return given, f"{given} " + ("in use (the job being replaced?)" if given in listening else "free")
    candidates = ([keep] if keep else []) + list(range(DEFAULT_PORT, DEFAULT_PORT + SEARCH))
    for port in candidates:
        if port not in listening and port not in holders:
            return port, f"{port} (chosen: free)"
    return None, (f"no free master port in {DEFAULT_PORT}-{DEFAULT_PORT + SEARCH - 1} on node 0; stop some jobs "
                  "or give one with --master-port")
