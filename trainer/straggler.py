"""The straggler rule: which rank (and node) holds a synchronous job back, from the per-rank timings the heartbeat
carries (contract.Beat). Rank 0's trainer counts each rank's streak of clearly slower windows into the heartbeat
(trainer/metrics.py); the orchestrator names the straggler from the heartbeat it read (`up`'s progress line,
`status`). Standard library only, like trainer/contract.py: the orchestrator imports it without torch
(.importlinter's `stdlib-contract`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .contract import Beat

# ---- the straggler: the rank (and its node) that holds a synchronous job back ----------------------------------
# A rank is named when its own work per step (Beat.rank_work_s) is at least this many times the median rank's.
# 1.3: the ranks of one healthy job differ by a few percent (seen: up to 12% on CPU ranks sharing 2 cores), a
# throttled node or a slow data path by tens of percent or more. With two nodes the median is their mean, so a
# node twice as slow as the other scores 1.33.
STRAGGLER_RATIO = 1.3
# The ratio alone named healthy ranks: with a tiny model on busy CPU hosts a rank's own work is a few ms per step,
# so one step preempted by another process (tens of ms) lifts its window's mean 1.3-5x, for that one window. As
# nvidia-resiliency-ext does (scores relative to the median over a report interval of many steps, a threshold, a
# minimum of reports), a single window is never enough: a rank is named only when it is clearly slower in
# STRAGGLER_WINDOWS windows in a row (3 x AGREE_EVERY = 24 steps: a preemption is one step or two, a throttled node
# or a slow data path lasts), and "clearly" also needs STRAGGLER_GAP_S more own work per step than the median: a
# few ms is what one preempted step spread over a window adds, and a job whose slowest rank costs it less than
# that per step has no straggler worth a user's time. The first window it is not clearly slower clears it.
STRAGGLER_WINDOWS = 3
STRAGGLER_GAP_S = 0.005


def straggler_scores(times: Sequence[float]) -> list[float]:
    """Each time over the median of all (1.0: typical; 2.0: twice the median). PURE."""
    mid = statistics.median(times) if times else 0.0
    return [t / mid if mid > 0 else 1.0 for t in times]


def node_times(times: Sequence[float], ranks_per_node: int) -> list[float]:
    """Each node's time: its slowest rank's (node of rank r = r // ranks_per_node). PURE."""
    per = max(1, ranks_per_node)
    return [max(times[i:i + per]) for i in range(0, len(times), per)]


@dataclass(frozen=True)
class Straggler:
    node: int
    rank: int
    score: float  # the rank's own work per step over the median rank's
    stage: int | None = None  # its pipeline stage (--pp), None: not pipelined

    def line(self) -> str:
        where = f"node {self.node} rank {self.rank}"
        if self.stage is not None:  # every stage waits on the slowest one: the stage is the news, the rank its place
            where = f"stage {self.stage} ({where})"
        return f"slowest: {where}, {self.score:.1f}x the median step"


def clearly_slower(times: Sequence[float], ratio: float = STRAGGLER_RATIO,
                   gap_s: float = STRAGGLER_GAP_S) -> list[bool]:
    """Per rank, whether its time this window is at least `ratio` times the median's and `gap_s` over it. PURE."""
    mid = statistics.median(times) if times else 0.0
    return [mid > 0 and t >= ratio * mid and t - mid >= gap_s for t in times]


def streaks(previous: Sequence[int] | None, times: Sequence[float]) -> tuple[int, ...]:
    """Per rank, windows in a row clearly slower, this one (`times`) included, capped at STRAGGLER_WINDOWS (the
    heartbeat keeps one digit a rank); `previous` None (or another job size): counted from this window. PURE."""
    prev = previous if previous is not None and len(previous) == len(times) else [0] * len(times)
    return tuple(min(STRAGGLER_WINDOWS, n + 1) if slow else 0
                 for n, slow in zip(prev, clearly_slower(times), strict=True))


def slowest(beat: Beat) -> Straggler | None:
    """The slowest rank and its node among those clearly slower than the median for STRAGGLER_WINDOWS windows in
    a row (Beat.rank_streak), else None (also for a heartbeat without per-rank timings: another program's, one
    process, before the first window, an older trainer's). PURE: the orchestrator calls it on the heartbeat it
    read."""
    times, streak = beat.rank_work_s, beat.rank_streak
    if not times or len(times) < 2 or not streak or len(streak) != len(times):
        return None
    scores = straggler_scores(times)
    named = [r for r in range(len(times)) if streak[r] >= STRAGGLER_WINDOWS]
    if not named:
        return None
    rank = max(named, key=scores.__getitem__)
    stages = beat.rank_stage if beat.rank_stage and len(beat.rank_stage) == len(times) else None
    return Straggler(rank // max(1, beat.ranks_per_node or 1), rank, scores[rank],
                     stages[rank] if stages else None)
