"""Run under torchrun (2 CPU processes, gloo): every strategy x precision x built-in model, built by the trainer's
own `state.build` and `state.wrap`, takes two optimizer steps with the trainer's `train_step` and one sharded
evaluation. Global rank 0 writes one JSON object to ARGV1: {"ddp/bf16/resnet20": "ok" | "Error: ..."}.

One process group for all 36 cases: a torchrun each would cost CI ~2 s of start-up per case."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from trainer import loop, state
from trainer.__main__ import exit_without_finalizing
from trainer.config import MODEL_NAMES, PRECISIONS, STRATEGIES, Config
from trainer.data import Split
from trainer.dist import context_from_env


def _case(strategy: str, precision: str, model: str) -> str:
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), strategy=strategy, precision=precision,
                 model=model, device="cpu", lr=0.05)
    ctx = context_from_env("cpu")
    torch.manual_seed(0)
    st = state.build(cfg, ctx)
    state.wrap(cfg, ctx, st)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        x = torch.randn(2, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (2,), generator=gen)
        loss = loop.train_step(st, x, y, cfg.lr, cfg.precision)
        if not torch.isfinite(loss):
            return f"loss {float(loss)}"
    # 5 test images on 2 ranks: rank 0 holds 3, rank 1 holds 2 (uneven shards, as with CIFAR's 10000 on 3 ranks).
    test = Split(torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (5,)))
    acc = loop.evaluate(st.model, test, ctx, cfg.precision, batch=2)
    return "ok" if 0.0 <= acc <= 1.0 else f"accuracy {acc}"


def main() -> None:
    # A case whose ranks fall out of step (a collective one rank skips) fails within a minute instead of hanging.
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: dict[str, str] = {}
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for model in MODEL_NAMES:
                t0 = time.monotonic()
                try:
                    results[f"{strategy}/{precision}/{model}"] = _case(strategy, precision, model)
                except Exception as e:  # noqa: BLE001 - every failure is a result to report, not a stop
                    results[f"{strategy}/{precision}/{model}"] = f"{type(e).__name__}: {str(e)[:300]}"
                    tdist.barrier()  # a rank that failed alone must not leave its peer in the next case's collective
                if tdist.get_rank() == 0:
                    print(f"{strategy}/{precision}/{model} {time.monotonic() - t0:.1f}s "
                          f"{results[f'{strategy}/{precision}/{model}']}", file=sys.stderr, flush=True)
    if tdist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # 36 DDP/FSDP models' gloo threads: see its docstring (SIGABRT at exit, seen here)
