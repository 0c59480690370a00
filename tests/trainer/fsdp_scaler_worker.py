"""Run under torchrun with 2 CPU processes (gloo): an FSDP2-sharded model in fp16 with the trainer's scaler;
an inf is put into rank 1's shard of one gradient only. Each rank writes `skipped|stepped SCALE` to ARGV1.RANK."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer import parallel
from trainer.__main__ import exit_without_finalizing
from trainer.config import Config
from trainer.dist import DistContext


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), strategy="fsdp", precision="fp16")
    parallel.shard(cfg, DistContext(rank, rank, 2, torch.device("cpu")), model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = parallel.grad_scaler(cfg, torch.device("cpu"), sharded=True)
    before = [p.to_local().clone() for p in model.parameters()]  # type: ignore[operator]
    scaler.scale(model(torch.ones(2, 4)).float().sum()).backward()
    if rank == 1:
        next(iter(model.parameters())).grad.to_local().fill_(float("inf"))  # type: ignore[union-attr]
    scaler.step(optimizer)
    scaler.update()
    same = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(), strict=True))  # type: ignore[operator]
    Path(f"{sys.argv[1]}.{rank}").write_text(f"{'skipped' if same else 'stepped'} {scaler.get_scale()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # gloo threads outlive the group: SIGABRT at finalization (see its docstring)
