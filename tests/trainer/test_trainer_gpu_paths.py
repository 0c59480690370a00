"""The CUDA/NCCL decisions, pinned without a GPU (unit): torch.cuda's probes are monkeypatched so the device
and distributed code takes its CUDA branch up to the point where real CUDA would be touched, and the pure
plans (backend, precision, DDP arguments, memory format, comm hook) are asserted directly."""

from __future__ import annotations

import datetime
import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kit.trainer_helpers import CPU, GPU3, base_args, metrics_lines, unit_cfg, unit_ctx
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from trainer import checkpoint, contract, dist, loop, parallel, snapshot, state
from trainer.__main__ import main
from trainer.config import Config
from trainer.dist import DistContext
from trainer.errors import DeviceError
from trainer.pace import AGREE_EVERY
from trainer.precision import grad_scaler, precision_plan


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Pretend this machine has N visible GPUs (only the probes; nothing may really run on them)."""
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int, int], None]:
    def setenv(rank: int, local_rank: int, world: int) -> None:
        for k, v in {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world}.items():
            monkeypatch.setenv(k, str(v))
    return setenv


# --- device and backend ------------------------------------------------------------------------------------

def test_backend_is_nccl_on_cuda_and_gloo_on_cpu() -> None:
    assert dist.choose_backend(GPU3) == "nccl" and unit_ctx(GPU3).backend == "nccl"
    assert dist.choose_backend(CPU) == "gloo" and unit_ctx(CPU).backend == "gloo"


def test_local_rank_3_takes_cuda_3(gpus: Callable[[int], None], torchrun_env: Callable[[int, int, int], None]) -> None:
    gpus(4)
    torchrun_env(7, 3, 8)  # second node of two, fourth GPU
    ctx = dist.context_from_env("auto")
    assert ctx.device == GPU3 and ctx.rank == 7 and ctx.backend == "nccl"


def test_more_local_ranks_than_gpus_is_refused(gpus: Callable[[int], None],
                                               torchrun_env: Callable[[int, int, int], None]) -> None:
    gpus(2)
    torchrun_env(3, 3, 4)
    with pytest.raises(DeviceError, match="local rank 3 needs GPU 3 but only 2 are visible.*--nproc_per_node to 2"):
        dist.context_from_env("auto")


def test_auto_without_cuda_is_cpu_and_forced_cuda_is_refused(gpus: Callable[[int], None]) -> None:
    gpus(0)
    assert dist.context_from_env("auto").device == CPU
    with pytest.raises(DeviceError, match="CUDA is not available"):
        dist.context_from_env("cuda")


def test_cpu_wins_over_visible_gpus(gpus: Callable[[int], None]) -> None:
    gpus(8)
    assert dist.context_from_env("cpu").device == CPU


def test_init_process_group_args_bind_nccl_to_our_gpu() -> None:
    kw = dist.init_kwargs(unit_ctx(GPU3, rank=3, world=4), 42)
    assert kw == {"backend": "nccl", "timeout": datetime.timedelta(seconds=42), "device_id": GPU3}
    assert dist.init_kwargs(unit_ctx(CPU, world=2), 5) == {"backend": "gloo", "timeout": datetime.timedelta(seconds=5)}


def test_set_device_comes_before_init_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a GPU shows the effect (NCCL's communicator and every tensor on cuda:0 otherwise): the order, here."""
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.append(("init", kw)))
    dist.init(unit_ctx(GPU3, rank=3, world=4), 30)
    assert [c[0] for c in calls] == ["set_device", "init"] and calls[0][1] == GPU3
    assert calls[1][1]["device_id"] == GPU3 and calls[1][1]["backend"] == "nccl"


def test_one_cuda_process_selects_its_gpu_and_joins_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a GPU shows set_device's effect; the calls are what a CPU can check."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append("set_device"))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.append("init"))
    dist.init(unit_ctx(torch.device("cuda", 0)), 30)
    dist.init(unit_ctx(CPU), 30)
    assert calls == ["set_device"]


# --- precision -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("precision", "dtype", "autocast_on", "scaler_on"), [
    ("fp32", torch.float32, False, False),
    ("bf16", torch.bfloat16, True, False),
    ("fp16", torch.float16, True, True),
])
def test_precision_plan(precision: str, dtype: torch.dtype, autocast_on: bool, scaler_on: bool) -> None:
    plan = precision_plan(precision)
    assert (plan.autocast_dtype, plan.autocast_enabled, plan.scaler_enabled) == (dtype, autocast_on, scaler_on)


def test_only_fp16_gets_an_enabled_scaler_of_the_devices_kind() -> None:
    """Real scalers: on the CPU, enabled for fp16 only; on a CUDA device, a CUDA scaler: enabled where CUDA is,
    disabled by torch with a warning where it is not (that it then scales: the GPU tier, tests/trainer/gpu)."""
    assert [grad_scaler(CPU, p).is_enabled() for p in ("fp16", "bf16", "fp32")] == [True, False, False]
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = grad_scaler(GPU3, "fp16")
    assert scaler._device == "cuda" and scaler.is_enabled() == cuda
    assert any("CUDA is not available" in str(w.message) for w in caught) == (not cuda)


@pytest.mark.parametrize(("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                                  ("fp32", torch.float32)])
def test_autocast_computes_in_the_plans_dtype(precision: str, dtype: torch.dtype) -> None:
    """A real forward under the trainer's autocast, on the CPU (the CUDA autocast is the same call with
    device_type "cuda": only a GPU runs it)."""
    with loop.autocast(CPU, precision):
        out = nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype == dtype


def test_resuming_a_checkpoint_without_scaler_state_into_fp16_starts_a_fresh_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # stands in for the fp16 CUDA scaler
    snapshot._load_scaler(scaler, {})  # what a disabled (fp32/bf16) scaler saved
    assert scaler.get_scale() == 65536.0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    snapshot._load_scaler(disabled, {"scale": 8.0})  # fp16 -> fp32: ignored, and no error
    assert not disabled.is_enabled() and disabled.state_dict() == {}


# --- which options the device accepts -------------------------------------------------------------------------

def test_sync_batch_norm_cannot_run_on_cpu_tensors(tmp_path: Path) -> None:
    """Why --sync-bn stays CUDA-only: a real SyncBatchNorm forward in a real gloo group refuses CPU tensors
    (torch checks the input's device before it looks at the world size)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            nn.SyncBatchNorm(3).train()(torch.randn(4, 3, 2, 2))
    finally:
        torch.distributed.destroy_process_group()


# --- model placement and the DDP wrap -----------------------------------------------------------------------------

def test_ddp_gets_the_gpu_index_and_nothing_on_cpu() -> None:
    common = {parallel._FORWARD_SYNC_KW: False, "gradient_as_bucket_view": True}
    assert parallel.ddp_kwargs(GPU3) == {**common, "device_ids": [3], "output_device": 3}
    assert parallel.ddp_kwargs(CPU) == common


def test_comm_hooks() -> None:
    """Our own hooks (they divide before the cast: tests/trainer/test_trainer_parallel.py), not torch's."""
    assert parallel.comm_hook("fp16") not in (None, default_hooks.fp16_compress_hook)
    assert parallel.comm_hook("bf16") not in (None, default_hooks.bf16_compress_hook)
    assert parallel.comm_hook("none") is None


class _RecordingDDP(nn.Module):
    """Stands in for DistributedDataParallel: records what it was given."""

    seen: list[tuple[nn.Module, dict[str, Any]]] = []
    hooks: list[Any] = []

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        _RecordingDDP.seen.append((module, kwargs))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        _RecordingDDP.hooks.append((state, hook))


def test_sync_bn_is_converted_before_the_ddp_wrap_with_the_gpu_and_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "DistributedDataParallel", _RecordingDDP)
    _RecordingDDP.seen, _RecordingDDP.hooks = [], []
    cfg = unit_cfg(model="resnet20", sync_bn=True, grad_compression="bf16")
    st = state.build(cfg, unit_ctx(CPU))  # the CUDA move itself needs a GPU; the order does not
    state.wrap(cfg, unit_ctx(GPU3, rank=3, world=4), st)
    (module, kwargs), = _RecordingDDP.seen
    assert module is st.model and kwargs == {"device_ids": [3], "output_device": 3,
                                                   parallel._FORWARD_SYNC_KW: False, "gradient_as_bucket_view": True}
    kinds = {type(m) for m in module.modules()}
    assert nn.SyncBatchNorm in kinds and nn.BatchNorm2d not in kinds
    (hook_state, hook), = _RecordingDDP.hooks
    assert hook_state is None and hook.__qualname__.startswith("_divide_then_compress")


# --- checkpoints map to the right device ------------------------------------------------------------------------

def test_checkpoint_load_maps_to_the_given_device(tmp_path: Path) -> None:
    """A real load onto another device than the one saved from: torch's "meta" device stands in for a GPU."""
    info = checkpoint.newest_valid(_saved_run(tmp_path).ckpt_dir)
    assert info is not None
    loaded = checkpoint.load(info, torch.device("meta"))
    assert {t.device.type for t in loaded["model"].values()} == {"meta"}


def _saved_run(tmp_path: Path) -> Config:
    cfg = Config(data_dir=tmp_path, ckpt_dir=tmp_path / "ck", model="tiny")
    st = state.build(cfg, unit_ctx(CPU))
    st.pos.step = 5
    checkpoint.check_writable(cfg.ckpt_dir)  # creates it, as rank 0 does before training
    checkpoint.save(cfg.ckpt_dir, snapshot.to_checkpoint(cfg, unit_ctx(CPU), st, 64), step=5, epoch=0,
                    epoch_complete=False, world_size=1, keep=3)
    return cfg


def test_rank_0_of_a_cuda_job_reads_the_checkpoint_into_cpu_memory(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Never onto the GPU it was saved from (cuda:0 of another process): the CPU, then each rank copies."""
    cfg, devices = _saved_run(tmp_path), []
    real = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda info, device: devices.append(device) or real(info, device))
    loaded, err = snapshot._load_on_main(cfg, unit_ctx(GPU3, rank=0, world=4))
    assert err is None and devices == [CPU] and loaded["step"] == 5
    assert all(t.device == CPU for t in loaded["model"].values())


def test_restore_broadcasts_through_this_processs_own_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only NCCL shows the effect (its broadcast needs the tensor on this rank's GPU); the argument, here."""
    cfg, seen = _saved_run(tmp_path), {}
    monkeypatch.setattr(torch.distributed, "broadcast_object_list",
                        lambda objs, src, device: seen.update(src=src, device=device))
    st = state.build(cfg, unit_ctx(CPU))
    snapshot.restore(cfg, DistContext(0, 3, 4, GPU3), st)  # rank 0 on its node's fourth GPU
    assert seen == {"src": 0, "device": GPU3} and st.pos.step == 5


# --- SIGTERM on the last step of an epoch -------------------------------------------------------------------------

def test_sigterm_on_an_epochs_last_step_keeps_its_metrics_line_and_resumes_exactly(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = tmp_path / "ck"
    args = base_args(data_dir, ck, "--epochs", "2", "--batch-size", "64")  # 512 images: 8 steps per epoch
    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a: Any, **k: Any) -> torch.Tensor:
        out = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 8:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the trainer's handler
        return out

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    assert main(args) == contract.EXIT_STOPPED
    info = checkpoint.newest_valid(ck)
    assert info is not None and info.step == 8
    assert info.manifest["epoch"] == 1 and info.manifest["epoch_complete"] is True
    assert [(r["epoch"], r["step"], r["test_acc"]) for r in metrics_lines(ck)] == [(1, 8, None)]

    monkeypatch.setattr(loop, "train_step", real_step)
    assert main([*args, "--resume"]) == 0
    assert [(r.get("event"), r["epoch"], r["step"]) for r in metrics_lines(ck)] == \
        [(None, 1, 8), ("resume", 1, 8), (None, 2, 16)]
    assert metrics_lines(ck)[-1]["test_acc"] is not None


# --- no host-device synchronisation each step ---------------------------------------------------------------

def test_the_stop_and_save_flags_are_agreed_every_few_steps_not_every_step(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading an all_reduce's result on a GPU waits for every queued kernel: once a step, it would drain
    the queue each step. 2 epochs of 32 fast steps agree 64 / AGREE_EVERY times (epoch ends fall on multiples),
    on three flags each: stop, save due, evaluation due; plus at steps 1, 2 and 3, before a step is measured
    (Cadence)."""
    agreements = []
    real = dist.agree

    def counting(ctx: DistContext, loss: torch.Tensor, *flags: bool, step_s: float = 0.0,
                 times: tuple[float, ...] = ()) -> dist.Agreement:
        agreements.append(len(flags))
        return real(ctx, loss, *flags, step_s=step_s, times=times)

    monkeypatch.setattr(dist, "agree", counting)
    assert main(base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "16")) == 0
    assert agreements.count(3) == 64 // AGREE_EVERY + 3
