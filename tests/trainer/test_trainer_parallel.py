"""trainer/parallel.py: the DDP wrap's decisions (item 9 of issue 21) and FSDP's, some with real processes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from kit.trainer_helpers import REPO, child_env, torchrun_cmd
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainer import models, parallel
from trainer.config import Config

CPU = torch.device("cpu")


def _cfg(**kw: object) -> Config:
    return Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_real_ddp_on_gloo_fp16_hook_divides_before_the_cast_and_no_buffer_broadcast(tmp_path: Path) -> None:
    """2 processes, gloo, the real DistributedDataParallel. Gradients 70000 and 10000: torch's
    fp16_compress_hook casts 70000 to fp16 first (inf); ours divides first and gets the mean, 40000 (with the
    gradients as views into the buckets). No broadcast of BatchNorm's buffers before each forward (issue 31)."""
    out = tmp_path / "result.json"
    cmd = torchrun_cmd(2, [str(out)], entry=(str(REPO / "tests" / "trainer" / "ddp_wrap_worker.py"),))
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["fp16_hook_grad"] == 40000.0
    assert result["broadcast_buffers"] is False and result["gradient_as_bucket_view"] is True


def test_fsdp_shards_each_residual_block() -> None:
    vit = models.build("vit-cifar")
    assert parallel.shard_units(vit) == list(vit.blocks)
    r20 = models.build("resnet20")
    assert len(parallel.shard_units(r20)) == 9 and parallel.shard_units(models.build("tiny")) == []


def test_fsdp_mixed_precision_computes_in_the_precision_and_reduces_in_fp32() -> None:
    assert parallel.mp_policy("fp32") == MixedPrecisionPolicy()
    assert parallel.mp_policy("bf16") == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert parallel.mp_policy("fp16") == MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_fp16_under_fsdp_gets_the_sharded_scaler_that_agrees_on_inf_across_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank holds a shard of the gradients: an inf in one shard must skip the step everywhere, which
    ShardedGradScaler's all_reduce of found_inf does (the plain GradScaler decides per rank). A process group
    stands in (its query patched): one process has none, and gets the plain scaler
    (test_trainer_matrix.py::test_fsdp_fp16_takes_the_sharded_scaler_only_with_a_process_group)."""
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    scaler = parallel.grad_scaler(_cfg(precision="fp16"), CPU, sharded=True)
    assert isinstance(scaler, ShardedGradScaler) and scaler.is_enabled()
    assert not parallel.grad_scaler(_cfg(precision="bf16"), CPU, sharded=True).is_enabled()
    assert not isinstance(parallel.grad_scaler(_cfg(precision="fp16"), CPU), ShardedGradScaler)


@pytest.mark.slow
def test_fsdp_fp16_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """2 processes, gloo, a real fully_shard model in fp16 (MixedPrecisionPolicy) with the trainer's scaler; the
    same scaler code runs on CUDA (not run here)."""
    worker = (str(REPO / "tests" / "trainer" / "fsdp_scaler_worker.py"), str(tmp_path / "rank"))
    proc = subprocess.run(torchrun_cmd(2, [], entry=worker), cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [(tmp_path / f"rank.{r}").read_text() for r in (0, 1)]
    assert seen == ["skipped 32768.0", "skipped 32768.0"]  # the scale backed off from 2**16 on both


def test_memory_counts_local_params_grads_and_optimizer_state() -> None:
    model = torch.nn.Linear(10, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n = 110 * 4
    assert parallel.expected_memory(model, opt) == parallel.Memory(n, n, n)
    assert parallel.memory(model, opt) == parallel.Memory(n, 0, 0)
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    assert parallel.memory(model, opt) == parallel.Memory(n, n, n)


def test_vit_cifar_has_more_parameters_than_the_cifar_resnets() -> None:
    count = lambda name: sum(p.numel() for p in models.build(name).parameters())  # noqa: E731
    assert count("vit-cifar") > 2 * count("resnet18") > 2 * count("resnet20")
    assert models.build("vit-cifar")(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


