"""A process's output read line by line with every wait bounded: a blocking `readline` on a program that prints
nothing would hang its test until pytest's timeout, which does not say what the test waited for."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import IO


class LineReader:
    """A thread reads `stream` into a queue; `next` waits a bounded time for a line ("" at the end, as readline)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None, "the process's output is not a pipe"
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")

    def next(self, timeout: float, what: str) -> str:
        try:
            return self.lines.get(timeout=max(timeout, 0))
        except queue.Empty:
            raise AssertionError(f"no line within {timeout:.0f} s while waiting for {what}") from None

    def until(self, done: Callable[[list[str]], bool], timeout: float, what: str) -> list[str]:
        """Lines (without their newline) until `done(lines)` holds or the stream ends; AssertionError past `timeout`."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while not done(seen):
            try:
                line = self.next(deadline - time.monotonic(), what)
            except AssertionError as e:
                raise AssertionError(f"{e}; the last lines: {seen[-20:]}") from None
            if not line:
                break
            seen.append(line.rstrip("\n"))
        return seen


def table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the first rich table titled `title` in `text`, each a list of its cells, a cell's lines
    joined with a space: a table laid out in 100 columns (output to a file) wraps a long cell over several lines."""
    lines = text[text.index(title):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("┡")) + 1
    rows: list[list[str]] = []
    for line in lines[start:]:
        if not line.lstrip().startswith("│"):
            break
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{have} {more}".strip() for have, more in zip(rows[-1], cells, strict=True)]
    return rows
