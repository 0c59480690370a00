"""trainer.plot: the drawn data are the records of metrics.jsonl, restarts are marked, bad input is one line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from kit.trainer_helpers import REPO

from trainer.contract import STEP_KIND
from trainer.plot import PANELS, draw, parse

RECORDS = [
    {"epoch": 1, "step": 8, "train_loss": 2.1, "test_acc": 0.31, "images_per_s": 900.0, "lr": 0.1},
    {"epoch": 2, "step": 16, "train_loss": 1.7, "test_acc": None, "images_per_s": 950.0, "lr": 0.08},
    {"event": "restart", "restart": 1, "cause": "node 1 (b) exited with code 137", "step": 16, "epoch": 2},
    {"epoch": 3, "step": 24, "train_loss": 1.2, "test_acc": 0.52, "images_per_s": 910.0, "lr": 0.03},
]


def write(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_each_panel_draws_its_field_against_step_and_marks_the_restart(tmp_path: Path) -> None:
    run = parse((write(tmp_path / "m.jsonl", RECORDS, tail='{"epoch": 4, "st')).read_text())
    assert run.skipped == 1  # the torn last line of a crash
    fig = draw(run, "job x")
    for ax, (key, _) in zip(fig.axes, PANELS, strict=True):
        line, *markers = ax.get_lines()
        expected = [(r["step"], r[key]) for r in RECORDS if "event" not in r and r[key] is not None]
        assert [tuple(p) for p in line.get_xydata().tolist()] == expected
        assert [m.get_xdata()[0] for m in markers] == [16]  # the restart, on every panel
    assert fig.axes[0].get_legend().get_texts()[-1].get_text() == "restart 1"


STEP_RECORDS = [{"kind": STEP_KIND, "step": s, "epoch": 1 + (s - 1) // 8, "loss": 2.5 - s / 20, "lr": 0.1,
                 "images_per_s": 800.0 + s, "step_s": 0.04, "mfu": None} for s in range(4, 25, 4)]


def test_step_records_are_drawn_per_step_and_left_out_of_the_epoch_points(tmp_path: Path) -> None:
    """Loss, images/s and lr: a line through the step records, the epoch records as points over it; test
    accuracy (per epoch only) as before."""
    mixed = sorted(RECORDS + STEP_RECORDS, key=lambda r: (r["step"], "kind" in r))
    fig = draw(parse(write(tmp_path / "m.jsonl", mixed).read_text()), "job x")
    for ax, (key, _) in zip(fig.axes, PANELS, strict=True):
        lines = ax.get_lines()
        epoch_points = [(r["step"], r[key]) for r in RECORDS if "event" not in r and r[key] is not None]
        if key == "test_acc":
            assert [tuple(p) for p in lines[0].get_xydata().tolist()] == epoch_points
            continue
        field = {"train_loss": "loss"}.get(key, key)
        assert [tuple(p) for p in lines[0].get_xydata().tolist()] == [(r["step"], r[field]) for r in STEP_RECORDS]
        assert [tuple(p) for p in lines[1].get_xydata().tolist()] == epoch_points
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2] == ["every 4 steps", "per epoch"]


def test_the_command_writes_a_png_of_the_expected_size(tmp_path: Path) -> None:
    metrics = write(tmp_path / "metrics.jsonl", RECORDS)
    res = subprocess.run([sys.executable, "-m", "trainer.plot", str(metrics)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert png_size(tmp_path / "metrics.png") == (1000, 700)
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, trainer.plot; print(' '.join(sys.modules))"], cwd=REPO,
        capture_output=True, text=True, timeout=60).stdout.split()


def test_nothing_to_plot_is_one_error_line(tmp_path: Path) -> None:
    for content in (None, "", "garbage\n", json.dumps(RECORDS[2]) + "\n"):
        path = tmp_path / "m.jsonl"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        res = subprocess.run([sys.executable, "-m", "trainer.plot", str(path)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
        assert str(path) in res.stderr
