"""First-day self-test of one node (`python -m orchestrate check` runs it in the job's image on every node):
a few training steps of the trainer's own model with the chosen precision (a gradient scaler with fp16), on
synthetic data, then a checkpoint saved, found by its manifest, loaded and compared. One process, no peers.

    python -m trainer.selftest --precision bf16 [--device cuda] [any trainer option]

Prints one line, trainer.contract.SELFTEST_MARK + JSON (fields: contract.SELFTEST_FIELDS); exit 0 when every
part passed, 1 when one failed (the line's `error` says which and why).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, config, dist, state
from .contract import SELFTEST_FIELDS, SELFTEST_MARK
from .device import check_device
from .loop import train_step
from .snapshot import to_checkpoint

STEPS = 3
BATCH = 16  # small: the self-test checks that a step runs, its speed is bench/'s business


def synthetic_batch(device: torch.device, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x.to(device), y.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(cfg: config.Config, st: state.TrainState, device: torch.device) -> tuple[float, float]:
    """(the last step's loss, seconds per step after the first, which pays for warm-up and cuDNN's choice)."""
    x, y = synthetic_batch(device, cfg.batch_size)
    loss = train_step(st, x, y, cfg.lr, cfg.precision)
    _sync(device)
    start = time.perf_counter()
    for _ in range(STEPS - 1):
        loss = train_step(st, x, y, cfg.lr, cfg.precision)
    value = float(loss.item())  # one host sync, after the timed steps
    st.pos.step = STEPS
    return value, (time.perf_counter() - start) / (STEPS - 1)


def checkpoint_roundtrip(cfg: config.Config, ctx: dist.DistContext, st: state.TrainState) -> tuple[int, bool]:
    """Save as training does (atomic file + manifest), find it as a resume does, load it on the device:
    (its size in bytes, whether every weight came back equal)."""
    path = checkpoint.save(cfg.ckpt_dir, to_checkpoint(cfg, ctx, st, cfg.batch_size), step=st.pos.step,
                           epoch=0, epoch_complete=False, world_size=1, keep=1)
    info = checkpoint.newest_valid(cfg.ckpt_dir)
    if info is None:
        return path.stat().st_size, False
    saved = checkpoint.load(info, ctx.device)["model"]
    same = all(torch.equal(value, saved[name]) for name, value in st.model.state_dict().items())
    return path.stat().st_size, same


def run(argv: list[str], folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(SELFTEST_FIELDS)
    out["steps"] = 0
    try:
        cfg, _ = config.parse(["--data-dir", str(folder), "--ckpt-dir", str(folder), "--batch-size", str(BATCH),
                               *argv])
        ctx = dist.context_from_env(cfg.device)
        out.update(device=str(ctx.device), precision=cfg.precision)
        check_device(cfg, ctx)
        st = state.build(cfg, ctx)
        out["scaler"] = st.scaler.is_enabled()
        out["loss"], out["step_s"] = train_steps(cfg, st, ctx.device)
        out["steps"] = STEPS
        if not math.isfinite(out["loss"]):
            raise ValueError(f"the loss is {out['loss']} after {STEPS} steps")
        out["ckpt_bytes"], out["ckpt_ok"] = checkpoint_roundtrip(cfg, ctx, st)
        if not out["ckpt_ok"]:
            raise ValueError("the checkpoint loaded back differs from the model that was saved")
    except Exception as err:  # every failure becomes the one line the orchestrator shows for this node
        out["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="ddp-selftest-") as tmp:
        out = run(sys.argv[1:] if argv is None else argv, Path(tmp))
    print(SELFTEST_MARK + json.dumps(out), flush=True)
    return 0 if out["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
