"""SIGHUP: the terminal of an attached `up` went away (a laptop lid closed, the SSH session to this machine dropped).

The job runs on, exactly as with --detach: `up` stops watching without stopping anything, prints nothing more (the
terminal is gone: a write to it fails), and exits 0. `status` and `logs -f` find the job by its labels.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class TerminalGone(BaseException):  # noqa: N818 - an event, not an error (like KeyboardInterrupt)
    """Raised in the main thread while `up` watches; a BaseException, as KeyboardInterrupt, so that no
    `except Exception` on the way swallows it."""


class Hangup:
    """Whether the terminal went away, and what that does: before the watch, `up` goes on to start the job (as
    --detach would) and the watch ends at its start; during the watch, at once."""

    def __init__(self) -> None:
        self.happened = False
        self._watching = False

    @contextmanager
    def handled(self) -> Iterator[None]:
        """SIGHUP handled for the duration (in the main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    @contextmanager
    def watching(self) -> Iterator[None]:
        if self.happened:
            raise TerminalGone
        self._watching = True
        try:
            yield
        finally:
            self._watching = False

    def _on_hangup(self, _signum: int, _frame: FrameType | None) -> None:
        self.happened = True
        _silence()
        if self._watching:
            raise TerminalGone


def _silence() -> None:
    """stdout and stderr to /dev/null: whatever `up` would still print goes nowhere instead of failing on a
    terminal that is gone (EIO) and turning the detach into an error."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)
