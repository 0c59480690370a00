"""Rank 0's heartbeat as the progress line under the streamed logs."""

from __future__ import annotations

import time

from rich.console import Console

from orchestrate.watch.health import Beat

PROGRESS_EVERY_S = 30.0  # without a terminal (CI, a pipe), a progress line this often instead of a live one


class ProgressView:
    """Rank 0's heartbeat as one line under the streamed logs: live on a terminal (rich), else printed every
    PROGRESS_EVERY_S seconds (a CI log gets a line now and then, not a redraw per poll)."""

    def __init__(self, console: Console) -> None:
        from rich.live import Live

        self.console = console
        self.live = Live(console=console, transient=True, auto_refresh=False) if console.is_terminal else None
        self.printed_at = 0.0
        self.shown: str | None = None
        if self.live is not None:
            self.live.start()

    def show(self, beat: Beat | None) -> None:
        if beat is None or beat.raw == self.shown:
            return
        self.shown = beat.raw
        line = f"progress: {beat.progress_line()}"
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(line, style="bold"), refresh=True)
        elif time.monotonic() - self.printed_at >= PROGRESS_EVERY_S or beat.state == "done":
            self.printed_at = time.monotonic()
            self.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()

