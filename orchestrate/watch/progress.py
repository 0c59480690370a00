"""Rank 0's heartbeat as the progress line under the streamed logs."""

from __future__ import annotations

import time

from rich.console import Console

from orchestrate.probe.heartbeat import Beat

PROGRESS_EVERY_S = 30.0  # without a terminal (CI, a pipe), a progress line this often instead of a live one


class ProgressView:
    """Rank 0's heartbeat as one line under the streamed logs, with the slowest node and rank when one is clearly
    slower: live on a terminal (rich), else printed every PROGRESS_EVERY_S seconds (a CI log gets a line now and
    then, not a redraw per poll), and at once when the straggler named changes (named, another, none)."""

    def __init__(self, console: Console) -> None:
        from rich.live import Live

        self.console = console
        self.live = Live(console=console, transient=True, auto_refresh=False) if console.is_terminal else None
        self.printed_at = 0.0
        self.shown: str | None = None
        self.straggler: str | None = None
        if self.live is not None:
            self.live.start()

    def show(self, beat: Beat | None) -> None:
        if beat is None or beat.raw == self.shown:
            return
        self.shown = beat.raw
        straggler, named_before = beat.straggler_line(), self.straggler
        self.straggler = straggler
        line = f"progress: {beat.progress_line()}" + (f"; {straggler}" if straggler else "")
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(line, style="bold"), refresh=True)
        elif (time.monotonic() - self.printed_at >= PROGRESS_EVERY_S or beat.state == "done"
              or straggler_change(named_before, straggler)):
            self.printed_at = time.monotonic()
            self.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def straggler_change(before: str | None, now: str | None) -> bool:
    """PURE: whether the straggler named changed: another node and rank, or named where none was, or the other way
    round (its score alone moving is no news)."""
    def who(line: str | None) -> str | None:
        return line.split(",")[0] if line else None

    return who(before) != who(now)
