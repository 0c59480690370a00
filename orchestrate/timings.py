"""Wall time of each phase of `up` (`up --timings`): the probe, apply and watch phases each time themselves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timings:
    """Wall time of each phase of `up`, in order (`up --timings`)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.phases: list[tuple[str, float]] = []
        self.channels: dict[str, int] = {}  # host -> the most SSH channels held there at once

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((name, time.monotonic() - t0))


    def render(self) -> str:
        parts = [f"{name} {took:.2f}" for name, took in self.phases]
        line = f"timings (s): {', '.join(parts)}; total {time.monotonic() - self.start:.2f}"
        if self.channels:  # OpenSSH allows 10 per connection by default (MaxSessions)
            line += "\npeak SSH channels per host: " + ", ".join(f"{h} {n}" for h, n in self.channels.items())
        return line
