"""The one place the command line's rich Consoles are made: a terminal gets its own width; a file (a batch job's
output, nohup, a CI log, a pipe) gets what a 100-column terminal shows, without the blanks that pad a terminal's
lines."""

from __future__ import annotations

import re
import sys
from typing import Any, TextIO, cast

from rich.console import Console
from rich.text import Text

FILE_WIDTH = 100  # a file's columns: tables are as wide as their content, and at most this
_BLANKS_AT_END = re.compile(r"[ ]+\n")


def console_for(stderr: bool = False) -> Console:
    """stdout's (or stderr's) Console. emoji=False: an image tag such as ":new" before a colon would print as an
    emoji; highlight=False: no colours guessed into plain text."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, highlight=False, emoji=False)
    # cast: rich takes any object with write and flush, its hint says IO[str]
    return _FileConsole(file=cast(TextIO, _NoTrailingBlanks(stream)), width=FILE_WIDTH, highlight=False, emoji=False)


class _FileConsole(Console):
    """A table is laid out in FILE_WIDTH columns, as on a terminal; a line of text is never broken (a terminal folds
    it on the screen only, and a log read with grep finds it whole)."""

    def print(self, *objects: Any, **options: Any) -> None:
        options.setdefault("soft_wrap", all(isinstance(o, (str, Text)) for o in objects))
        super().print(*objects, **options)


class _NoTrailingBlanks:
    """A text stream that drops the blanks at the end of each line (a table's centred title pads both sides):
    blanks are held back until the next write shows whether a line end follows them."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._held = ""

    def write(self, text: str) -> int:
        joined = self._held + text
        kept = joined.rstrip(" ")
        self._held = joined[len(kept):]
        self._stream.write(_BLANKS_AT_END.sub("\n", kept))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"
