"""A node's log lines as `up`, `logs` and the failure report print them: `[node R] ` before each, secrets masked,
terminal control sequences shown as escapes."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence

from rich.console import Console

from orchestrate.masking import mask_text

# Terminal control sequences (ESC ... and other C0/C1 controls but tab) from a node's log could move the cursor,
# rewrite the screen or set the window title: they are shown as printable escapes instead.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(line: str) -> str:
    """PURE: a log line with its control characters as printable escapes."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)


def print_lines(console: Console, rank: int, text: str, secrets: Sequence[str]) -> None:
    text = mask_text(text, list(secrets))  # before splitting: a secret may span lines
    for line in text.splitlines():
        console.print(f"[node {rank}] {shown(line)}", markup=False, highlight=False, soft_wrap=True)


def follow_lines(console: Console, rank: int, chunks: Iterable[bytes], secrets: Sequence[str],
                 stop: threading.Event | None = None) -> None:
    """Print a followed log stream line by line with the node prefix (`logs -f` and `up`'s watcher); the stream
    is closed at the end (a scheduler's stream then hands its connection back)."""
    pending = ""
    try:
        for chunk in chunks:
            if stop is not None and stop.is_set():
                return
            pending += chunk.decode(errors="replace")
            *lines, pending = pending.split("\n")
            print_lines(console, rank, "\n".join(lines), secrets)
        if pending:
            print_lines(console, rank, pending, secrets)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
