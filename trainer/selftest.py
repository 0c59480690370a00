"""First-day self-test of one node (`python -m orchestrate check` runs it in the job's image on every node, under
torchrun with the job's process count: one process per GPU): a few training steps of the trainer's own model
with the job's strategy and precision (DDP or FSDP2, a gradient scaler with fp16), on synthetic data, then a
checkpoint in the job's format saved and restored (a .pt and its manifest for DDP, a sharded DCP folder for FSDP).

    torchrun --nnodes 1 --master_addr 127.0.0.1 --nproc_per_node 8 -m trainer.selftest --strategy fsdp --precision bf16 --device cuda

Every process prints one line, trainer.contract.SELFTEST_MARK + JSON (fields: contract.SELFTEST_FIELDS); exit 0
when every part passed, 1 when one failed (the line's `error` says which and why).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import checkpoint, config, dcp_checkpoint, dist, precision, state, strategies
from .contract import SELFTEST_FIELDS, SELFTEST_MARK
from .device import check_device
from .snapshot import save_sharded, to_checkpoint
from .strategy import Strategy

STEPS = 3
BATCH = 16  # small: the self-test checks that a step runs, its speed is bench/'s business
DIST_TIMEOUT_S = 120  # a process that died: its peers give up after this long instead of the trainer's 300 s


def synthetic_batch(device: torch.device, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x.to(device), y.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(cfg: config.Config, ctx: dist.DistContext, st: state.TrainState,
                strategy: Strategy) -> tuple[float, float]:
    """(the last step's loss, seconds per step after the first, which pays for warm-up and cuDNN's choice)."""
    _, shares = strategy.data_share(ctx)  # a pipeline's stages all take their replica's images
    x, y = synthetic_batch(ctx.device, cfg.batch_size * ctx.world_size // shares)
    dtype = precision.resolve(cfg.precision, ctx.device)  # "auto" (the trainer's default) as the job resolves it

    def step() -> torch.Tensor:
        return strategy.train_step(st, x, y, cfg.lr, dtype, 0, contextlib.nullcontext)

    loss = step()
    _sync(ctx.device)
    start = time.perf_counter()
    for _ in range(STEPS - 1):
        loss = step()
    value = float(loss.item())  # one host sync, after the timed steps
    st.pos.step = STEPS
    return value, (time.perf_counter() - start) / (STEPS - 1)


def checkpoint_roundtrip(cfg: config.Config, ctx: dist.DistContext, st: state.TrainState) -> tuple[int, bool]:
    """DDP: global rank 0 saves as training does (atomic file + manifest), finds it as a resume does and loads
    it; every rank learns the answer. (its size in bytes, whether every weight came back equal)."""
    size, same = 0, True
    if ctx.is_main:
        path = checkpoint.save(cfg.ckpt_dir, to_checkpoint(cfg, ctx, st, cfg.batch_size * ctx.world_size),
                               step=st.pos.step, epoch=0, epoch_complete=False, world_size=ctx.world_size, keep=1)
        info = checkpoint.newest_valid(cfg.ckpt_dir)
        size = path.stat().st_size
        saved = checkpoint.load(info, ctx.device)["model"] if info is not None else None
        same = saved is not None and all(torch.equal(v, saved[k]) for k, v in st.model.state_dict().items())
    return size, not dist.any_rank(ctx, not same)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def sharded_roundtrip(cfg: config.Config, ctx: dist.DistContext, st: state.TrainState) -> tuple[int, bool]:
    """FSDP: every rank writes its shards into the step folder as training does, the weights are zeroed, and
    every rank restores its shards as a resume does (collective). (the folder's size, whether every rank got
    its weights back)."""
    folder = save_sharded(cfg, ctx, st, cfg.batch_size * ctx.world_size)
    before = {name: _local(value).clone() for name, value in st.model.state_dict().items()}
    with torch.no_grad():
        for param in st.model.parameters():
            param.zero_()  # so that only the restore can bring the weights back
    dcp_checkpoint.restore(cfg, ctx, st.model, st.optimizer)
    same = all(torch.equal(_local(value), before[name]) for name, value in st.model.state_dict().items())
    size = sum(p.stat().st_size for p in folder.iterdir()) if ctx.is_main else 0
    return size, not dist.any_rank(ctx, not same)


def run(argv: list[str], folder: Path) -> dict[str, Any]:
    """The steps and the round trip on this process (collective under torchrun); its answer."""
    out: dict[str, Any] = dict.fromkeys(SELFTEST_FIELDS)
    out["steps"] = 0
    ctx = None
    try:
        cfg, _ = config.parse(["--data-dir", str(folder), "--ckpt-dir", str(folder), "--batch-size", str(BATCH),
                               "--dist-timeout", str(DIST_TIMEOUT_S), *argv])
        ctx = dist.context_from_env(cfg.device)
        out.update(rank=ctx.rank, world_size=ctx.world_size, device=str(ctx.device),
                   precision=precision.resolve(cfg.precision, ctx.device),
                   strategy=cfg.strategy)
        check_device(cfg, ctx)
        dist.init(ctx, cfg.dist_timeout)
        strategy = strategies.for_config(cfg)
        st = strategy.build(cfg, ctx)
        strategy.wrap(cfg, ctx, st)  # DDP's wrapper, as the trainer builds it after a restore; FSDP is sharded already
        out["scaler"] = st.scaler.is_enabled()
        out["loss"], out["step_s"] = train_steps(cfg, ctx, st, strategy)
        out["steps"] = STEPS
        if not math.isfinite(out["loss"]):
            raise ValueError(f"the loss is {out['loss']} after {STEPS} steps")
        roundtrip = sharded_roundtrip if strategy.sharded_checkpoints else checkpoint_roundtrip
        out["ckpt_bytes"], out["ckpt_ok"] = roundtrip(cfg, ctx, st)
        if not out["ckpt_ok"]:
            raise ValueError("the checkpoint restored differs from the model that was saved")
    except Exception as err:  # every failure becomes the one line the orchestrator shows for this node
        out["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    # Every process of one torchrun shares the folder (FSDP's shards meet in it): torchrun's run id and
    # rendezvous port name it (the id is "none" unless --rdzv-id is given; two torchruns on one host differ in port).
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}-{os.environ.get('MASTER_PORT', '')}"
    folder = Path(tempfile.gettempdir()) / f"ddp-selftest-{run_id}"
    folder.mkdir(exist_ok=True)
    out = run(sys.argv[1:] if argv is None else argv, folder)
    # One write (torchrun runs python -u: print's text and newline would be two, and the processes' lines interleave).
    sys.stdout.write(SELFTEST_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if out["error"] is None else 1


if __name__ == "__main__":
    # No destroy_process_group and no interpreter finalization: every collective is done once the line is out,
    # and on the test hosts rank 0 once hung in the gloo group's teardown after its peer had gone (seen: the
    # container never ended); gloo's threads can also abort a finalizing interpreter (trainer/__main__.py).
    code = main()
    sys.stdout.flush()
    os._exit(code)
