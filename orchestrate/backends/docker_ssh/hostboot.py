"""A host's boot and its Docker daemon's start, read over SSH (what the Docker-over-SSH scheduler's Ranks.boot answers,
probe/bootchange.py tells what changed)."""

from __future__ import annotations

from orchestrate.probe.bootchange import Boot
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection

SCRIPT = scripts.text("boot.sh")
PROBE_TIMEOUT_S = 8.0


def parse_boot(out: str) -> Boot | None:
    """PURE: the script's output; None when it printed no boot id (not a Linux host)."""
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if not lines:
        return None
    return Boot(lines[0], lines[1] if len(lines) > 1 else None)


def read_boot(conn: Connection) -> Boot | None:
    """The host's boot now; None when the host does not answer over SSH (or tells nothing)."""
    try:
        return parse_boot(conn.run(["sh", "-c", SCRIPT], timeout=PROBE_TIMEOUT_S).out)
    except Exception:  # unreachable: the caller keeps its own "unreachable" verdict
        return None
