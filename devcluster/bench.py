"""Time to bring up and tear down 1, 2, 4 hosts (median of a few runs): `python -m devcluster bench`."""

from __future__ import annotations

import statistics
import time

from .cluster import Cluster
from .errors import DevclusterError


def bench(sizes: tuple[int, ...] = (1, 2, 4), reps: int = 3) -> list[tuple[int, float, float]]:
    """(n_hosts, median seconds up, median seconds down) per size."""
    rows = []
    for n in sizes:
        ups, downs = [], []
        for _ in range(reps):
            t0 = time.monotonic()
            c = Cluster.create(n)
            t1 = time.monotonic()
            left = c.close()
            t2 = time.monotonic()
            if left:
                raise DevclusterError(f"cluster {c.name}: teardown left {'; '.join(left)}")
            ups.append(t1 - t0)
            downs.append(t2 - t1)
        rows.append((n, statistics.median(ups), statistics.median(downs)))
    return rows
