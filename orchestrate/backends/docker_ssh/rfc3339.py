"""Docker's RFC 3339 times (container states' StartedAt/FinishedAt), read as epoch seconds: one module below both
the watcher's ranks and `status`'s job view."""

from __future__ import annotations

import datetime


def docker_time(stamp: str) -> float | None:
    """PURE: epoch seconds of one of Docker's RFC 3339 UTC times (a fraction of up to 9 digits, which datetime
    does not take: cut to microseconds); None for an empty, a zero (never) or a malformed one."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        at = datetime.datetime.fromisoformat(f"{head}.{frac[:6].ljust(6, '0')}+00:00").timestamp()
    except ValueError:
        return None
    return at if at > 0 else None
