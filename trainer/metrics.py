"""Logging with the rank in every line (non-main ranks quiet) and the per-epoch metrics.jsonl."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def setup_logging(rank: int, is_main: bool) -> None:
    """Rank 0 logs INFO; the others only warnings and errors, so N processes do not print N copies."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    handler._trainer = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_trainer", False):  # ours from an earlier call; leave others' handlers alone
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)


def append_metrics(ckpt_dir: Path, record: dict[str, Any]) -> None:
    """One JSON object per line; called by global rank 0 only."""
    record = {**record, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        with (ckpt_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        # Metrics are not worth a crash of rank 0 (which would leave the others waiting); a full disk is
        # reported clearly by the next checkpoint save.
        logging.getLogger(__name__).warning("cannot append to %s: %s", ckpt_dir / METRICS_FILE, e)
