"""The GPU tier: what only a GPU can show, on one GPU (`make test-gpu`, or scripts/gpu-check.sh with the benchmark
and a report; tests/trainer/gpu/conftest.py fails every test where CUDA is missing, saying why).

What one GPU can test: CUDA kernels, autocast and the CUDA GradScaler, cuDNN, channels_last, the host-sync
checks, the compiled step, and NCCL in a process group of world_size 1 (the group, the communicator, its
collectives as no-ops of one rank; FSDP2's sharding code over one rank). What it cannot: anything between two NCCL
ranks (an all-reduce that moves data, DDP's bucketing, FSDP's all-gathers and reduce-scatters between shards,
ShardedGradScaler's agreement between ranks, NVLink/P2P/SHM/IB transports): two NCCL ranks need two GPUs (NCCL
fails with `Duplicate GPU detected` when two ranks share a device). On CPU those paths run on gloo
(tests/trainer/test_trainer_matrix.py).

- The trainer under torchrun (--nproc_per_node 1, NCCL) in DDP and FSDP, bf16 and fp16: fp16 with torch's CUDA
  GradScaler, whose state the checkpoint holds. One process does not shard (trainer/state.py shards only with
  peers), so FSDP2 itself, with its mixed-precision policy and ShardedGradScaler, is also driven directly: the
  trainer's own shard(), optimizer, scaler and train_step in a one-rank NCCL group.
- The self-test (`orchestrate check` runs it on every node) on CUDA.
- No host-device synchronisation in a training step after the first: torch.cuda.set_sync_debug_mode("error")
  raises at any call that makes the host wait (tests/trainer/test_trainer_host_syncs.py counts them on CPU).
- bench/gpu_throughput.py: its figures and its goals (exit 1 below them).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from kit.net import free_port
from kit.trainer_helpers import REPO, base_args, metrics_lines, newest_state, run_torchrun

from trainer import data, loop, metrics, models, optim, parallel, selftest
from trainer.__main__ import main
from trainer.config import Config
from trainer.device import place
from trainer.dist import DistContext
from trainer.state import Position, TrainState

pytestmark = pytest.mark.gpu
CUDA0 = torch.device("cuda", 0)
COMBINATIONS = [(s, p) for s in ("ddp", "fsdp") for p in ("bf16", "fp16")]


def cuda_args(data_dir: Path, ckpt_dir: Path, *extra: str) -> list[str]:
    """The trainer's test arguments with the device switched to CUDA (the last --device wins)."""
    return [*base_args(data_dir, ckpt_dir, *extra), "--device", "cuda"]


@pytest.mark.parametrize(("strategy", "precision"), COMBINATIONS)
def test_the_trainer_runs_on_one_gpu(strategy: str, precision: str, data_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    args = cuda_args(data_dir, ckpt, "--model", "resnet20", "--epochs", "1", "--batch-size", "128",
                     "--strategy", strategy, "--precision", precision)
    done = run_torchrun(1, args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    epoch = [m for m in metrics_lines(ckpt) if "train_loss" in m][-1]
    assert math.isfinite(epoch["train_loss"]), epoch
    if strategy == "ddp":  # FSDP's checkpoint is a folder of shards; its scaler is the next test's
        scaler = newest_state(ckpt)["scaler"]
        assert (scaler.get("scale", 0.0) > 0) == (precision == "fp16"), scaler  # a disabled scaler saves {}


@pytest.fixture
def one_rank_nccl() -> Iterator[None]:
    torch.cuda.set_device(CUDA0)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                             device_id=CUDA0)
    try:
        yield
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp2_sharded_trains_in_half_precision_with_its_scaler(precision: str, one_rank_nccl: None) -> None:
    cfg = Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), model="resnet20", strategy="fsdp", precision=precision)
    model = parallel.shard(cfg, DistContext(0, 0, 1, CUDA0), place(models.for_run(cfg), CUDA0))
    st = TrainState(model, model, optim.build(cfg, model.parameters(), sharded=True),
                    parallel.grad_scaler(cfg, CUDA0, sharded=True), Position())
    before = [p.full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    x, y = selftest.synthetic_batch(CUDA0, 64)
    losses = [float(loop.train_step(st, x, y, 0.05, precision).item()) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses), losses
    assert st.scaler.is_enabled() == (precision == "fp16")
    after = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_selftest_passes_on_cuda(precision: str, tmp_path: Path) -> None:
    out = selftest.run(["--precision", precision, "--device", "cuda", "--model", "resnet18"], tmp_path)
    assert out["error"] is None, out
    assert (out["device"], out["scaler"], out["steps"]) == ("cuda:0", precision == "fp16", selftest.STEPS)
    assert out["ckpt_ok"] is True


@pytest.fixture
def no_sync_after_first_step(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every step after the first, its batch and the step itself run under set_sync_debug_mode("error"): a host
    sync raises there. Returns the list of steps seen. The heartbeat's read is held off, as on CPU."""
    seen: list[int] = []
    real_step, real_batches = loop.train_step, data.TrainLoader.batches

    def guarded(fn: Any, *a: Any, **k: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error" if seen else "default")
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def batches(self: data.TrainLoader, *a: Any, **k: Any) -> Iterator[Any]:
        it = real_batches(self, *a, **k)
        while (item := guarded(next, it, None)) is not None:
            yield item

    def step(*a: Any, **k: Any) -> torch.Tensor:
        out = guarded(real_step, *a, **k)
        seen.append(len(seen))
        return out

    monkeypatch.setattr(data.TrainLoader, "batches", batches)
    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(metrics, "HEARTBEAT_S", 1e9)
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_no_host_sync_in_a_cuda_training_step(precision: str, no_sync_after_first_step: list[int], data_dir: Path,
                                              tmp_path: Path, inprocess: None) -> None:
    args = cuda_args(data_dir, tmp_path, "--epochs", "1", "--batch-size", "64", "--log-every", "1000",
                     "--precision", precision)
    assert main(args) == 0
    assert len(no_sync_after_first_step) == 8


def test_the_gpu_benchmark_meets_its_goals() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_throughput.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)  # the figures, in the tier's output (-s, or the failure report)
    assert "step loop:" in done.stdout and "steady epochs:" in done.stdout and "airbench" in done.stdout, done.stderr
    assert "compiled (inductor): step loop:" in done.stdout, done.stdout  # eager and --compile both measured
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
