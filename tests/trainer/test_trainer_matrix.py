"""Every strategy x precision x built-in model, for real on 2 gloo processes (issue 31), and the decisions behind
the FSDP fixes: BatchNorm in its own fp32 group, a foreach optimizer under FSDP, HSDP over several nodes, and
evaluation batches in lockstep for a sharded model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit.net import free_port
from kit.trainer_helpers import REPO, base_args, child_env, metrics_lines, run_torchrun, torchrun_cmd
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer import dcp_checkpoint, loop, models, optim, parallel
from trainer.config import MODEL_NAMES, PRECISIONS, STRATEGIES, Config
from trainer.errors import ConfigError


def _cfg(**kw: object) -> Config:
    return Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_every_strategy_precision_and_model_takes_steps_and_evaluates_on_2_processes(tmp_path: Path) -> None:
    """Before the fixes: FSDP bf16/fp16 failed on every BatchNorm model (`expected scalar type BFloat16 but found
    Float`), FSDP fp16 on every other model (`aten._fused_sgd_.default does not have a sharding strategy`), and
    FSDP evaluation of 5 images on 2 ranks hung in an all-gather (one rank ran a batch more)."""
    out = tmp_path / "matrix.json"
    cmd = torchrun_cmd(2, [str(out)], entry=(str(REPO / "tests" / "trainer" / "matrix_worker.py"),))
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    expected = {f"{s}/{p}/{m}" for s in STRATEGIES for p in PRECISIONS for m in MODEL_NAMES}
    assert set(results) == expected
    assert {case: r for case, r in results.items() if r != "ok"} == {}


def test_batch_norm_keeps_fp32_weights_and_casts_its_output_under_fsdp_mixed_precision() -> None:
    assert parallel.norm_policy("fp32") == MixedPrecisionPolicy()
    assert parallel.norm_policy("bf16") == MixedPrecisionPolicy(output_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32)
    assert parallel.norm_policy("fp16").param_dtype is None  # the running statistics are fp32: so are the weights


def test_each_blocks_batch_norms_are_one_group_and_the_stems_another() -> None:
    r18 = models.build("resnet18")
    units = parallel.shard_units(r18)
    groups = parallel.batch_norm_groups(r18, units)
    assert len(groups) == len(units) + 1  # one per block, then the stem's
    assert [len(g) for g in groups[:3]] == [2, 2, 3]  # bn1, bn2 (+ the shortcut's where it downsamples)
    assert groups[-1] == [r18.stem[1]]
    every = [n for n in r18.modules() if isinstance(n, nn.BatchNorm2d)]
    assert sorted(map(id, every)) == sorted(id(n) for g in groups for n in g)
    assert parallel.batch_norm_groups(models.build("vit-cifar"), []) == []  # LayerNorm follows the job's policy


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp_steps_with_foreach_sgd_and_ddp_with_the_fused_kernel(precision: str) -> None:
    params = list(nn.Linear(2, 2).parameters())
    fsdp = optim.build(_cfg(strategy="fsdp", precision=precision), params)
    ddp = optim.build(_cfg(strategy="ddp", precision=precision), params)
    assert fsdp.defaults["foreach"] is True and not fsdp.defaults["fused"]
    assert ddp.defaults["fused"] is True


@pytest.mark.parametrize(("shard_over", "world", "local", "shape"), [
    ("node", 16, 8, (2, 8)),   # 2 nodes of 8 GPUs: shard within a node, replicate across
    ("node", 8, 8, None),      # one node: flat FSDP
    ("node", 4, 1, None),      # one process per node: a replica per node would hold everything
    ("node", 12, 8, None),     # uneven nodes: flat
    ("all", 16, 8, None),      # asked for: every process holds 1/16
])
def test_fsdp_over_several_nodes_is_hsdp_unless_asked_to_shard_over_all(
        shard_over: str, world: int, local: int, shape: tuple[int, int] | None) -> None:
    assert parallel.mesh_shape(shard_over, world, local) == shape


def test_fsdp_shard_without_fsdp_is_refused() -> None:
    with pytest.raises(ConfigError, match="--fsdp-shard all applies to --strategy fsdp only"):
        _cfg(fsdp_shard="all")


@pytest.mark.parametrize(("n_test", "world", "batch", "counts"), [
    (5, 2, 2, [[2, 1], [2, 0]]),       # rank 0: samples 0, 2, 4; rank 1: 1, 3 and an empty batch
    (10000, 3, 500, None),             # CIFAR's test split on 3 ranks: 3334, 3333, 3333
])
def test_a_sharded_models_evaluation_runs_as_many_batches_on_every_rank(
        n_test: int, world: int, batch: int, counts: list[list[int]] | None) -> None:
    per_rank = [loop._eval_batches(torch.arange(r, n_test, world), batch, n_test, world, lockstep=True)
                for r in range(world)]
    assert len({len(parts) for parts in per_rank}) == 1
    assert sum(len(p) for parts in per_rank for p in parts) == n_test
    if counts is not None:
        assert [[len(p) for p in parts] for parts in per_rank] == counts
    # DDP evaluates its unwrapped replica with no collective inside: nothing to pad.
    assert len(loop._eval_batches(torch.arange(1, 5, 2), 2, 5, 2, lockstep=False)) == 1


@pytest.mark.slow
def test_fsdp_on_2_nodes_of_2_processes_is_hsdp_in_bf16_and_resumes_flat(data_dir: Path, tmp_path: Path) -> None:
    """Two torchrun agents on this machine stand for two nodes (LOCAL_WORLD_SIZE 2, WORLD_SIZE 4): a resnet20
    (BatchNorm) in bf16 on a (2 replicas x 2 shards) mesh checkpoints; one node of 2 processes resumes it."""
    ckpt = tmp_path / "ckpt"
    args = base_args(data_dir, ckpt, "--strategy", "fsdp", "--precision", "bf16", "--model", "resnet20",
                     "--batch-size", "8", "--epochs", "1")
    port = str(free_port())
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    agents = [subprocess.Popen([*node, "--node_rank", str(r), "-m", "trainer", *args, "--max-steps", "3"],
                               cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True) for r in (0, 1)]
    errs = [a.communicate(timeout=300)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs[0][-3000:]
    assert "2 nodes x 2 processes: sharded within a node, replicated across nodes (HSDP)" in errs[0]
    info = dcp_checkpoint.newest_valid(ckpt)
    assert info is not None and info.manifest.world_size == 4
    proc = run_torchrun(2, [*args, "--max-steps", "6", "--resume"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HSDP" not in proc.stderr and metrics_lines(ckpt)[-1]["step"] == 6
