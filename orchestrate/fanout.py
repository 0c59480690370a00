"""Run one function on every host (or node) in parallel, and collect every host's failure into one MultiHostError
instead of stopping at the first (as fabric's groups do). It knows no connection: the watcher fans out over the
scheduler's Ranks with it, the SSH layer over its connections."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from orchestrate.errors import MultiHostError

T = TypeVar("T")
R = TypeVar("R")


def fan_out(what: str, items: Sequence[T], fn: Callable[[T], R], label: Callable[[T], str],
            max_workers: int = 32) -> list[R]:
    """Run fn on every item in parallel; return results in order, or raise one error naming every failure."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        results: list[R] = []
        failures: dict[str, BaseException] = {}
        for item, future in zip(items, futures, strict=True):
            try:
                results.append(future.result())
            except Exception as err:  # collected and reported per host, never lost
                failures[label(item)] = err
    if failures:
        raise MultiHostError(what, failures)
    return results
