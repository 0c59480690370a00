"""A diverging run stops on every rank at the same step, says so in one line, exits EXIT_DIVERGED and never
writes a checkpoint of non-finite weights (real torchrun processes, and in-process runs)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from trainer_helpers import base_args, run_torchrun

from trainer import checkpoint, loop, metrics, state
from trainer.__main__ import main
from trainer.config import Config
from trainer.contract import DIVERGED_LINE, EXIT_DIVERGED
from trainer.dist import DistContext
from trainer.errors import DivergedError

HUGE_LR = ["--lr", "1e12", "--warmup-epochs", "0", "--momentum", "0"]


def test_two_ranks_stop_at_the_same_step_with_one_line(data_dir: Path, tmp_path: Path) -> None:
    res = run_torchrun(2, base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "16", *HUGE_LR))
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if DIVERGED_LINE in ln]
    assert len(lines) == 1, res.stderr[-3000:]  # one node: its local rank 0 says it
    assert re.search(rf"error: {DIVERGED_LINE} at step 8: loss (nan|inf), lr [0-9.e+]+; .*lower --lr", lines[0])
    # torchrun names the first worker's own code (then it stops the other with SIGTERM; torchrun exits 1).
    assert re.search(rf"exitcode\s*:\s*{EXIT_DIVERGED}\b", res.stderr), res.stderr[-3000:]
    assert checkpoint.newest_valid(tmp_path) is None and not list(tmp_path.glob("ckpt-*"))


def test_a_run_that_diverges_later_keeps_its_finite_checkpoints(data_dir: Path, tmp_path: Path,
                                                                inprocess: None) -> None:
    assert main(base_args(data_dir, tmp_path, "--epochs", "1", "--batch-size", "64")) == 0  # step 8, saved
    assert main(base_args(data_dir, tmp_path, "--epochs", "3", "--batch-size", "64", "--resume", *HUGE_LR)) \
        == EXIT_DIVERGED
    info = checkpoint.newest_valid(tmp_path)
    assert info is not None and info.step == 8
    weights = checkpoint.load(info, torch.device("cpu"))["model"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_nonfinite_weights_are_never_saved(tmp_path: Path) -> None:
    """A step can leave the weights non-finite while its loss was still finite: the save itself refuses."""
    cfg = Config(data_dir=tmp_path, ckpt_dir=tmp_path / "ck", model="tiny")
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    st = state.build(cfg, ctx)
    checkpoint.check_writable(cfg.ckpt_dir)
    with torch.no_grad():
        next(st.model.parameters())[0] = math.inf
    pace = loop.Pace(metrics.Heartbeat(cfg.ckpt_dir, True, 10, 1, 8))
    loader = type("L", (), {"global_batch": 8})()
    with pytest.raises(DivergedError, match=f"{DIVERGED_LINE} at step 0: weights not finite, lr 0.1; "):
        loop.save(cfg, ctx, st, loader, pace)  # type: ignore[arg-type]
    assert not list(cfg.ckpt_dir.glob("ckpt-*"))
