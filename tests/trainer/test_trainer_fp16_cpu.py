"""The fp16 path for real on the CPU (unit and in-process runs): fp16 autocast, torch's CPU GradScaler and the
fused SGD are the same code as on CUDA, so loss scaling, the skipped step on an overflow, the scale's update
and its checkpoint run here with no mock. What only a GPU shows: the speed, and cuBLAS's fp16 kernels."""

from __future__ import annotations

from pathlib import Path

import torch
from kit.trainer_helpers import base_args, metrics_lines, newest_state

from trainer import checkpoint, loop, snapshot, state
from trainer.__main__ import main
from trainer.config import Config
from trainer.dist import DistContext

CPU = torch.device("cpu")
CTX = DistContext(0, 0, 1, CPU)


def _state(tmp_path: Path, **kw: object) -> tuple[Config, state.TrainState]:
    cfg = Config(data_dir=tmp_path, ckpt_dir=tmp_path / "ck", model="tiny", precision="fp16", **kw)  # type: ignore[arg-type]
    return cfg, state.build(cfg, CTX)


def _weights(st: state.TrainState) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in st.model.parameters()])


def test_fp16_trains_with_an_enabled_cpu_scaler(data_dir: Path, tmp_path: Path, inprocess: None) -> None:
    assert main(base_args(data_dir, tmp_path, "--precision", "fp16", "--epochs", "1", "--batch-size", "64")) == 0
    saved = newest_state(tmp_path)
    assert saved["scaler"]["scale"] > 0 and saved["scaler"]["_growth_tracker"] >= 0  # an enabled scaler's state
    assert saved["optimizer"]["param_groups"][0]["fused"] is True
    assert metrics_lines(tmp_path)[-1]["test_acc"] > 0.3  # chance: 0.1


def test_an_overflow_skips_the_step_and_halves_the_scale(tmp_path: Path) -> None:
    cfg, st = _state(tmp_path)
    assert st.scaler.is_enabled() and st.scaler.get_scale() == 65536.0
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    before = _weights(st)
    loop.train_step(st, x * 1e6, y, lr=0.1, precision="fp16")  # activations beyond fp16's 65504: inf gradients
    assert st.scaler.get_scale() == 32768.0
    assert torch.equal(_weights(st), before)  # the optimizer step was skipped, momentum and all
    assert not st.optimizer.state or all(
        not torch.any(s["momentum_buffer"]) for s in st.optimizer.state.values() if s.get("momentum_buffer") is not None)
    st.scaler.update(1.0)  # a scale that cannot overflow on ordinary inputs, so the next step must count
    loop.train_step(st, x, y, lr=0.1, precision="fp16")
    assert not torch.equal(_weights(st), before)


def test_the_scalers_state_survives_a_resume(tmp_path: Path) -> None:
    cfg, st = _state(tmp_path)
    for _ in range(3):
        loop.train_step(st, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)), lr=0.1, precision="fp16")
    st.scaler.update(1024.0)  # as after a few overflows
    saved = snapshot.to_checkpoint(cfg, CTX, st, 8)
    st.pos.step = 3

    checkpoint.check_writable(cfg.ckpt_dir)
    checkpoint.save(cfg.ckpt_dir, saved, step=3, epoch=0, epoch_complete=False, world_size=1, keep=3)
    _, fresh = _state(tmp_path, resume=True)
    assert fresh.scaler.get_scale() == 65536.0
    snapshot.restore(cfg, CTX, fresh)
    assert fresh.scaler.state_dict() == st.scaler.state_dict() and fresh.scaler.get_scale() == 1024.0


def test_an_fp32_checkpoint_resumes_in_fp16(data_dir: Path, tmp_path: Path, inprocess: None) -> None:
    """The optimizer's saved `fused: None` must not replace the fused step that takes the scaler's scale."""
    assert main(base_args(data_dir, tmp_path, "--epochs", "1", "--batch-size", "64")) == 0
    assert main(base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "64", "--precision", "fp16",
                          "--resume")) == 0
    assert newest_state(tmp_path)["step"] == 16
