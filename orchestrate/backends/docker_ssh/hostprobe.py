"""Preflight's read of one host over SSH: one exec of probe.sh, read-only, its facts as text (what the Docker-over-SSH
backend's Daemons.probe_host answers); the clock rules and the table are probe/preflight.py's, the verdicts
plan/verdicts.py's, the run over every host pipeline/preflight.py's."""

from __future__ import annotations

import time

from orchestrate.config import Resources
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection

# Every shell fact preflight needs, gathered in ONE exec per host (each exec costs a process spawn on the
# host, which is what limits fan-out on small machines); the values arrive as positional arguments.
PROBE_SCRIPT = scripts.text("probe.sh")


def probe_host(conn: Connection, resources: Resources, rank: int, master_addr: str, master_ssh_port: int,
               dirs: dict[str, str]) -> dict[str, str]:
    """Run PROBE_SCRIPT once on the host (about the resolved `dirs`); return its facts."""
    argv = ["sh", "-c", PROBE_SCRIPT, "probe", dirs["data"], dirs["ckpt"], master_addr,
            "0" if rank == 0 else str(master_ssh_port), "1" if rank == 0 else "0", "1" if resources.gpus else "0",
            dirs["log"]]
    sent = time.time()
    res = conn.run(argv, timeout=60)
    facts: dict[str, str] = {"sent": repr(sent), "answered": repr(time.time())}
    for record in res.out.split("\0"):
        key, sep, value = record.partition("=")
        if sep:
            facts[key.strip()] = value
    return facts
