"""A run's curves from its metrics.jsonl: `python -m trainer.plot METRICS.jsonl [--out FILE.png]`.

Train loss, test accuracy, images/s and learning rate against the global step, one panel each; every automatic
restart (and every resume) is a vertical line on each panel. Where the run wrote step records (every --log-every
steps), the loss, images/s and learning-rate panels draw them, one point per record, with the epoch records'
figures as markers over them; test accuracy exists per epoch only. Headless (matplotlib's Agg) and without torch, so
`python -m orchestrate plot` uses it on the machine that runs the orchestrator.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import OneLineParser
from .contract import METRICS_FILE, STEP_KIND
from .errors import ConfigError

# (record field, panel title); the order of the panels.
PANELS = (("train_loss", "train loss"), ("test_acc", "test accuracy"), ("images_per_s", "images/s"),
          ("lr", "learning rate"))
STEP_FIELDS = {"train_loss": "loss", "images_per_s": "images_per_s", "lr": "lr"}  # panel -> step record field
SIZE_IN, DPI = (10.0, 7.0), 100  # a 1000 x 700 PNG


@dataclass
class Run:
    """The records of one metrics.jsonl: per-epoch ones (partial ones included) and resume/restart events."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # "kind": "train_step" records
    skipped: int = 0  # lines that are not records (a torn last line, garbage)


def parse(text: str) -> Run:
    """PURE: tolerant of what a crash leaves behind; a line that is not a record is counted, not fatal."""
    run = Run()
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            run.skipped += 1
            continue
        if not isinstance(record, dict):
            run.skipped += 1
        elif "event" in record:
            run.events.append(record | {"step": step})
        elif record.get("kind") == STEP_KIND:
            run.steps.append(record | {"step": step})
        else:
            run.epochs.append(record | {"step": step})
    return run


def draw(run: Run, title: str) -> Any:
    """The figure (returned, so tests can read the drawn data back from its axes)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, ever
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    for ax, (key, name) in zip(axes, PANELS, strict=True):
        steps, values = _points(run.steps, STEP_FIELDS.get(key, ""))
        if steps:
            ax.plot(steps, values, linewidth=1, label=f"every {_spacing(run.steps)} steps")
        ax.plot(*_points(run.epochs, key), marker="o", markersize=3, linestyle="none" if steps else "-",
                label="per epoch")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        for event in run.events:
            label = f"restart {event.get('restart')}" if event.get("event") == "restart" else "resume"
            ax.axvline(event["step"], color="tab:red", linestyle="--", linewidth=1, label=label)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    if run.events or run.steps:
        axes[0].legend(loc="upper right", fontsize="small")
    return fig


def _points(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def _spacing(steps: list[dict[str, Any]]) -> int:
    """The steps between two step records (--log-every), for the legend."""
    gaps = [b["step"] - a["step"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] > a["step"]]
    return min(gaps) if gaps else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m trainer.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", type=Path, help=f"a run's {METRICS_FILE} (in its checkpoint dir)")
    p.add_argument("--out", type=Path, default=None, help="PNG to write (default: metrics.png beside the input)")
    try:
        ns = p.parse_args(argv)
        out = plot_file(ns.metrics, ns.out or ns.metrics.with_name("metrics.png"), str(ns.metrics))
    except (PlotError, ConfigError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(f"wrote {out}")
    return 0


class PlotError(Exception):
    """Nothing to plot: the message names the file and what to do."""


def plot_file(metrics: Path, out: Path, title: str) -> Path:
    try:
        text = metrics.read_text(errors="replace")
    except OSError as err:
        raise PlotError(f"cannot read {metrics}: {err.strerror or err}; give a run's {METRICS_FILE}") from None
    return plot_text(text, out, title, str(metrics))


def plot_text(text: str, out: Path, title: str, source: str) -> Path:
    run = parse(text)
    if not run.epochs:
        raise PlotError(f"{source} holds no epoch records ({run.skipped} unreadable line(s)); a run writes one "
                        f"per epoch into {METRICS_FILE} in its checkpoint dir")
    fig = draw(run, title)
    try:
        fig.savefig(out)
    except OSError as err:
        raise PlotError(f"cannot write {out}: {err.strerror or err}") from None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
