"""Run under torchrun with 2 CPU processes (gloo): wraps real models with trainer.parallel.wrap_ddp and writes
what happened to the JSON file named by argv[1] (global rank 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer import parallel
from trainer.__main__ import exit_without_finalizing
from trainer.config import Config
from trainer.dist import context_from_env


def _cfg(**kw: object) -> Config:
    return Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), **kw)  # type: ignore[arg-type]


def main() -> None:
    ctx = context_from_env("cpu")
    dist.init_process_group("gloo")
    # One weight, one input per rank: the gradient is the input. 70000 alone does not fit in fp16 (max 65504);
    # the mean (70000 + 10000) / 2 = 40000 does.
    model = nn.Linear(1, 1, bias=False)
    nn.init.ones_(model.weight)
    ddp = parallel.wrap_ddp(_cfg(grad_compression="fp16"), ctx, model)
    ddp(torch.tensor([[70000.0 if ctx.rank == 0 else 10000.0]])).sum().backward()
    out: dict[str, object] = {"fp16_hook_grad": model.weight.grad.item()}  # type: ignore[union-attr]
    # The wrap's decisions, read back from the real DDP object around a BatchNorm model.
    wrapped = parallel.wrap_ddp(_cfg(), ctx, nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    out["broadcast_buffers"] = wrapped.broadcast_buffers
    out["gradient_as_bucket_view"] = wrapped.gradient_as_bucket_view
    if ctx.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(out))
    dist.barrier()
    # Out with the DDP objects alive: freeing a Reducer as main() returns, after the group's barrier, hung now and
    # then (the Reducer's last reference destroys the gloo group, which joins gloo's run loop while holding the
    # GIL; the run loop waits for the GIL to free the barrier's tensors). The trainer ends the same way.
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
