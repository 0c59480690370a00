"""Every strategy x precision x model, built and wrapped by the trainer's own strategy object, takes two
optimizer steps with the trainer's `train_step` and one sharded evaluation.

    matrix_worker.py OUT_DIR [MODEL ...]

Under torchrun (2 CPU processes, gloo): first every strategy x precision on tiny and resnet20 in one process with
no process group (as `python -m trainer` alone and a 1-GPU node run; the cases split between the ranks, before the
group exists), then every strategy x precision x MODEL (default: every built-in one) on the group, then FSDP's
gradient accumulation (_accumulation). Alone (`python matrix_worker.py`): the 1-process cases of MODEL. Every rank
writes OUT_DIR/rank<R>.json: {"ddp/bf16/resnet20": "ok" | "what failed", "1-process/fsdp/fp16/tiny": ...}, so a
case that fails on one rank only is seen (a collective to gather them would not survive the failures it reports).

What a case checks on each rank: the losses are finite; the weights this rank holds changed (fp16's scaler may
skip one step, backing off from its initial scale of 2**16, and no other); the evaluation counted every test
image exactly once.

One process group for all cases: a torchrun each would cost CI ~2 s of start-up per case."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as tdist

from trainer import loop, models, parallel, state, strategies
from trainer.__main__ import exit_without_finalizing
from trainer.config import MODEL_NAMES, PRECISIONS, STRATEGIES, Config
from trainer.data import Split
from trainer.dist import DistContext, context_from_env

STEPS = 2
# Two images per rank and step: at one, fp16's per-image gradients overflow at 2**16 and 2**15 alike for some models
# (both steps skipped, seen), and fp16 matrix products cost the CPU (no fp16 arithmetic) ~20 s per vit-cifar backward
# at two.
BATCH = 2
# Image side per model: the BatchNorm ResNets pool adaptively, so 16x16 images take the same code path (every
# layer, the strategy's wrapping, the scaler) at a quarter of the arithmetic; fp16 on this CPU has no fast kernels
# (resnet18's two fp16 steps took 15.7 s at 32x32 on 2 ranks, 3.2 s at 16x16). The GroupNorm ResNets stay at 32x32:
# at 16x16 their fp16 gradients overflowed at 2**16 and 2**15 alike (both steps skipped, seen). The ViT's position
# embedding is for 32x32's 64 patches.
SIDE = {"resnet18": 16, "resnet20": 16, "tiny": 16}
ONE_PROCESS = ("tiny", "resnet20")  # under torchrun: the 1-process cases' models (one process does not shard)
N_TEST = 5  # on 2 ranks: rank 0 holds 3, rank 1 holds 2 (uneven shards, as with CIFAR's 10000 on 3 ranks)


def _held(st: state.TrainState) -> list[torch.Tensor]:
    """Copies of what this rank holds of every parameter (its FSDP shards, or the whole tensors)."""
    return [parallel.local_part(p.detach()).clone() for p in st.model.parameters()]


def _side(model: str) -> int:
    return SIDE.get(model, 32)


def _steps(cfg: Config, st: state.TrainState, rank: int) -> list[str]:
    """STEPS steps on random batches; what went wrong. Every step runs whatever failed before it, and so does
    the evaluation: a rank that stopped early would leave its peer alone in a collective."""
    gen = torch.Generator().manual_seed(rank)
    failures, skipped = [], []
    for i in range(STEPS):
        x = torch.randn(BATCH, 3, _side(cfg.model), _side(cfg.model), generator=gen)
        y = torch.randint(0, 10, (BATCH,), generator=gen)
        scale = st.scaler.get_scale()
        loss = loop.train_step(st, x, y, cfg.lr, cfg.precision)
        if not torch.isfinite(loss):
            failures.append(f"loss {float(loss)} at step {i}")
        if st.scaler.get_scale() < scale:  # found_inf: the scaler skipped the step and backed off
            skipped.append(i)
    if len(skipped) > 1:  # one back-off from 2**16, at whichever step the scaled gradients first overflow
        failures.append(f"the scaler skipped steps {skipped}; one may be")
    return failures


@contextlib.contextmanager
def _vit_width(precision: str) -> Iterator[None]:
    """vit-cifar's fp16 cases at width 64 (4 heads) instead of 512: the same architecture (8 blocks, LayerNorms,
    attention, the stem and head FSDP wraps) for 1/60 of the arithmetic. fp16 on this CPU has no fast kernels: its
    two steps at full width took 24-45 s on each of 2 ranks, per strategy (half the matrix's CPU). Full width still
    runs every fp32 and bf16 case."""
    full = models.OWN_MODELS["vit-cifar"]
    if precision == "fp16":
        models.OWN_MODELS["vit-cifar"] = functools.partial(models.CifarViT, dim=64, heads=4)
    try:
        yield
    finally:
        models.OWN_MODELS["vit-cifar"] = full


def _case(strategy: str, precision: str, model: str, ctx: DistContext) -> str:
    with _vit_width(precision):
        return _case_as_built(strategy, precision, model, ctx)


def _case_as_built(strategy: str, precision: str, model: str, ctx: DistContext) -> str:
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), strategy=strategy, precision=precision,
                 model=model, device="cpu", lr=0.05)
    torch.manual_seed(0)
    strategy = strategies.for_config(cfg)
    st = strategy.build(cfg, ctx)
    strategy.wrap(cfg, ctx, st)
    before = _held(st)
    failures = _steps(cfg, st, ctx.rank)
    if all(torch.equal(a, b) for a, b in zip(before, _held(st), strict=True)):
        failures.append(f"no weight this rank holds changed in {STEPS} steps")
    side = _side(model)
    test = Split(torch.randint(0, 256, (N_TEST, 3, side, side), dtype=torch.uint8), torch.randint(0, 10, (N_TEST,)))
    correct, total = loop.evaluate_counts(st.model, test, ctx, cfg.precision, batch=2)
    if total != N_TEST or not 0 <= correct <= total:
        failures.append(f"evaluation counted {correct} correct of {total} images; the test split has {N_TEST}")
    return "; ".join(failures) or "ok"


def _reductions(cfg: Config, micro: int) -> tuple[list[torch.Tensor], int]:
    """One FSDP step on a fixed batch of 4 per rank in micro-batches of `micro` (0: none): the weights this rank
    holds after it, and how many reduce-scatters it ran."""
    ctx = context_from_env("cpu")
    torch.manual_seed(0)
    strategy = strategies.for_config(cfg)
    st = strategy.build(cfg, ctx)
    strategy.wrap(cfg, ctx, st)
    gen = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    calls, real = [0], tdist.reduce_scatter_single

    def counted(*a: object, **k: object) -> object:
        calls[0] += 1
        return real(*a, **k)  # type: ignore[arg-type]

    tdist.reduce_scatter_single = counted  # type: ignore[assignment]
    try:
        loop.train_step(st, x, y, cfg.lr, cfg.precision, micro=micro)
    finally:
        tdist.reduce_scatter_single = real
    return _held(st), calls[0]


def _accumulation() -> str:
    """FSDP gradient accumulation (--keep-global-batch on fewer processes): 2 micro-batches of 2 give the step of
    one batch of 4 (GroupNorm: per-image statistics, so the sums agree), with the reduce-scatters of one step."""
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), strategy="fsdp", precision="fp32", model="resnet20-gn",
                 device="cpu", lr=0.05)
    whole, once = _reductions(cfg, micro=0)
    parts, accumulated = _reductions(cfg, micro=2)
    if accumulated != once:
        return f"{accumulated} reduce-scatters in micro-batches of 2, {once} in one batch"
    if not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole, parts, strict=True)):
        return "micro-batches of 2 gave other weights than one batch of 4"
    return "ok"


def _run(case: str, results: dict[str, str], rank: int, work: Callable[[], str]) -> None:
    t0 = time.monotonic()
    try:
        results[case] = work()
    except Exception as e:  # noqa: BLE001 - every failure is a result to report, not a stop
        results[case] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"rank {rank} {case} {time.monotonic() - t0:.1f}s {results[case]}", file=sys.stderr, flush=True)


def main() -> None:
    out, models = Path(sys.argv[1]), sys.argv[2:] or list(MODEL_NAMES)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    results: dict[str, str] = {}
    # One process and no process group, as `python -m trainer` alone: before the group exists, each rank runs
    # its share of these cases (every case on one rank, both cores busy).
    alone = DistContext(0, 0, 1, torch.device("cpu"))
    singles = [(s, p, m) for s in STRATEGIES for p in PRECISIONS for m in (models if world == 1 else ONE_PROCESS)]
    for strategy, precision, model in singles[rank::world]:
        _run(f"1-process/{strategy}/{precision}/{model}", results, rank,
             lambda: _case(strategy, precision, model, alone))  # noqa: B023 - called at once
    if world == 1:
        (out / "rank0.json").write_text(json.dumps(results, indent=1))
        return
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # out of step: fails, never hangs
    ctx = context_from_env("cpu")
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for model in models:
                _run(f"{strategy}/{precision}/{model}", results, rank,
                     lambda: _case(strategy, precision, model, ctx))  # noqa: B023 - called at once
                tdist.barrier()  # a rank that failed alone must not leave its peer in the next case's collective
    _run("accumulation/fsdp/resnet20-gn", results, rank, _accumulation)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    tdist.destroy_process_group()

if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # 36 DDP/FSDP models' gloo threads: see its docstring (SIGABRT at exit, seen here)
