"""The smallest program `up --entry` runs: init, all_reduce, a tiny DDP model, checkpoints with a manifest, resume.

Run it: python -m orchestrate up --hosts hosts.txt --gpus 0 --image ddp-example-minimal \
            --entry /app/minimal/train.py -- --steps 50
It reads only the contract (docs/DESIGN.md §7): torchrun's RANK/LOCAL_RANK/WORLD_SIZE, and CKPT_DIR,
DATA_DIR, LOG_DIR, RESUME=1 from the orchestrator. Exit 0 when done, 143 after SIGTERM with a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from example_ckpt import EXIT_STOPPED, StopFlag, exit_without_finalizing, join_group, load_newest, save
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps in all")
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch or stop it)")
    args, extra = parser.parse_known_args()
    stop = StopFlag()
    device = join_group()  # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    contract = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DATA_DIR", "CKPT_DIR",
                                                 "LOG_DIR", "RESUME")}
    print("CONTRACT " + json.dumps({**contract, "argv": sys.argv[1:]}), flush=True)

    ones = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(ones)  # every rank takes part: 1 + 2 + ... + world
    assert ones.item() == world * (world + 1) / 2, ones
    print(f"all_reduce ok: {ones.item():g} on rank {rank} of {world}", flush=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1).to(device),
                                    device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    if os.environ.get("RESUME") == "1":
        # Only rank 0 reads (other nodes may not have the folder) and broadcasts: any world size resumes.
        box = [load_newest(os.environ["CKPT_DIR"]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device)
        if box[0] is not None:
            model.module.load_state_dict(box[0]["model"])
            opt.load_state_dict(box[0]["optimizer"])
            step = int(box[0]["step"])
        print(f"resumed at step {step}", flush=True)

    gen = torch.Generator().manual_seed(1000 + rank)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]], device=device)
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        flag = torch.tensor([1.0 if stop.set else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flag.item():
            checkpoint(model, opt, step, world, rank, done=False)
            print(f"stopped at step {step} after a checkpoint", flush=True)
            return EXIT_STOPPED
        x = torch.randn(32, 4, generator=gen).to(device)  # drawn on the CPU: the same numbers on any device
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w.T)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.ckpt_every == 0:
            checkpoint(model, opt, step, world, rank, done=False)
        time.sleep(args.step_seconds)
    checkpoint(model, opt, step, world, rank, done=True)
    # Every rank done before any tears its group down (gloo can abort the early one), and before DONE: every
    # rank's last step line is printed by then, so DONE is the job's last line (the ranks share one stream).
    dist.barrier()
    if rank == 0:
        print(f"DONE step={step} loss={loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    return 0


def checkpoint(model: DistributedDataParallel, opt: torch.optim.Optimizer, step: int, world: int, rank: int,
               done: bool) -> None:
    if rank == 0:  # the model is the same on every rank: one writer
        save(os.environ["CKPT_DIR"], {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                      "step": step}, step, epoch=int(done), epoch_complete=done, world_size=world)


if __name__ == "__main__":
    exit_without_finalizing(main())
