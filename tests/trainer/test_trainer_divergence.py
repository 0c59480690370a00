"""A diverging run stops on every rank at the same step, says so in one line, exits EXIT_DIVERGED and never
writes a checkpoint of non-finite weights (real torchrun processes, and in-process runs)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit.net import free_port
from kit.trainer_helpers import REPO, base_args, child_env

from trainer import checkpoint, defaults, metrics, saving, state, strategies
from trainer.__main__ import main
from trainer.config import Config
from trainer.contract import DIVERGED_LINE, EXIT_DIVERGED
from trainer.dist import DistContext
from trainer.errors import DivergedError
from trainer.pace import LoopState

HUGE_LR = ["--lr", "1e12", "--warmup-epochs", "0", "--momentum", "0"]


def test_every_rank_stops_at_the_same_step_and_says_so_in_its_own_line(data_dir: Path, tmp_path: Path) -> None:
    """Two nodes of one process each (two torchrun agents, as the orchestrator starts them): a node's local rank 0
    writes the line, so here every rank writes its own, and the step each rank stopped at is read from that rank."""
    args = base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "16", *HUGE_LR)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "-m", "trainer", *args], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [node.communicate(timeout=180)[1] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    steps = []
    for err in errs:
        lines = [ln for ln in err.splitlines() if DIVERGED_LINE in ln]
        assert len(lines) == 1, err[-3000:]  # one line per node
        found = re.search(rf"error: {DIVERGED_LINE} at step (\d): loss (nan|inf), lr [0-9.e+]+; .*lower --lr",
                          lines[0])
        assert found, lines[0]
        steps.append(found.group(1))
        # torchrun names its worker's own code (and exits 1).
        assert re.search(rf"exitcode\s*:\s*{EXIT_DIVERGED}\b", err), err[-3000:]
    # Both at one step, the first agreement to see the loss non-finite (the first three steps agree each:
    # Cadence); the step's lr made it so at step 2.
    assert steps == ["2", "2"], steps
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
    pace = LoopState(metrics.Heartbeat(cfg.ckpt_dir, True, 10, 1, 8), defaults.resolve(cfg, "cpu", False, 8),
                     strategies.for_config(cfg))
    loader = type("L", (), {"global_batch": 8})()
    with pytest.raises(DivergedError, match=f"{DIVERGED_LINE} at step 0: weights not finite, lr 0.1; "):
        saving.save(cfg, ctx, st, loader, pace)  # type: ignore[arg-type]
    assert not list(cfg.ckpt_dir.glob("ckpt-*"))
