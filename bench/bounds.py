"""How every benchmark ends: each figure printed beside its baseline and its bound, and the exit code.

A figure past its bound makes the script exit 1, so that a figure quoted in docs/benchmarks.md cannot regress
silently: rerun the command beside it. The bound is the goal where the issue set one; else what the docs claim.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One measured figure: `value` in `unit`, against `baseline` (what it is compared with, in words and value),
    within `bound` (at least it when `higher_is_better`, else at most)."""

    name: str
    value: float
    unit: str
    baseline: str
    bound: float
    higher_is_better: bool

    def within(self) -> bool:
        return self.value >= self.bound if self.higher_is_better else self.value <= self.bound

    def line(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        verdict = "ok" if self.within() else "PAST THE BOUND"
        return (f"{self.name}: {self.value:.3g} {self.unit} | baseline: {self.baseline} | "
                f"bound: {sign} {self.bound:g} {self.unit} | {verdict}")


def finish(figures: Sequence[Figure]) -> int:
    """Print the figures (and the machine they were measured on); the exit code: 1 if any is past its bound."""
    print(f"\nfigures ({os.cpu_count()} CPU cores, {platform.machine()}, load average "
          f"{os.getloadavg()[0]:.1f}):")
    for f in figures:
        print(f"  {f.line()}")
    missed = [f.name for f in figures if not f.within()]
    if missed:
        print(f"past the bound: {', '.join(missed)}")
    return 1 if missed else 0
