"""A character-level language model on a text file from DATA_DIR, trained with DDP under `up --entry`.

Run it: put the text at <data dir>/<--text> on every node, then
  python -m orchestrate up --hosts hosts.txt --gpus 0 --image ddp-example-charlm \
      --entry '-m charlm.train' -- --steps 200 --text input.txt
The model sees --context characters and predicts the next (embedding → MLP). Each rank draws its own
windows; DDP averages the gradients. Rank 0 checkpoints by the manifest convention (with the vocabulary),
SIGTERM checkpoints and exits 143, RESUME=1 continues from the newest valid checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from example_ckpt import EXIT_STOPPED, StopFlag, exit_without_finalizing, join_group, load_newest, save
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class CharModel(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Flatten(), nn.Linear(context * dim, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="input.txt", help="text file, relative to DATA_DIR")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--context", type=int, default=8, help="characters the model sees")
    p.add_argument("--batch-size", type=int, default=64, help="windows per rank and step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch or stop it)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    stop = StopFlag()
    path = Path(os.environ.get("DATA_DIR", ".")) / args.text
    if not path.is_file():
        print(f"error: no text at {path}; put the file in the data dir on every node", file=sys.stderr)
        return 2
    text = path.read_text(encoding="utf-8")
    device = join_group()  # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    print("CONTRACT " + json.dumps({k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DATA_DIR",
                                    "CKPT_DIR", "LOG_DIR", "RESUME")} | {"argv": argv}), flush=True)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(ch) for ch in text], dtype=torch.long, device=device)
    if len(data) <= args.context + 1:
        print(f"error: {path} has {len(data)} characters; need more than --context {args.context}", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    model = DistributedDataParallel(CharModel(len(vocab), args.context).to(device),
                                    device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if os.environ.get("RESUME") == "1":
        box = [load_newest(os.environ["CKPT_DIR"]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device)
        if box[0] is not None:
            if box[0]["vocab"] != vocab:
                print("error: the text's characters differ from the checkpoint's; start without --resume",
                      file=sys.stderr)
                return 2
            model.module.load_state_dict(box[0]["model"])
            opt.load_state_dict(box[0]["optimizer"])
            step = int(box[0]["step"])
        print(f"resumed at step {step}", flush=True)

    def checkpoint(done: bool) -> None:
        if rank == 0:
            save(os.environ["CKPT_DIR"], {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                          "step": step, "vocab": vocab}, step, epoch=int(done),
                 epoch_complete=done, world_size=world)

    gen = torch.Generator().manual_seed(step * world + rank)
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        flag = torch.tensor([1.0 if stop.set else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flag.item():
            checkpoint(done=False)
            print(f"stopped at step {step} after a checkpoint", flush=True)
            return EXIT_STOPPED
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
        x = torch.stack([data[s:s + args.context] for s in starts.tolist()])
        y = data[starts.to(device) + args.context]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.ckpt_every == 0:
            checkpoint(done=False)
        time.sleep(args.step_seconds)
    checkpoint(done=True)
    if rank == 0:
        print(f"sample: {sample(model.module, vocab, text[:args.context], 60)!r}", flush=True)
        print(f"DONE step={step} loss={loss.item():.4f}", flush=True)
    dist.barrier()  # every rank done before any tears its group down (gloo can abort the early one)
    dist.destroy_process_group()
    return 0


@torch.no_grad()
def sample(model: CharModel, vocab: list[str], prompt: str, n: int) -> str:
    out = [vocab.index(ch) for ch in prompt]
    context = len(prompt)
    for _ in range(n):
        logits = model(torch.tensor([out[-context:]], device=next(model.parameters()).device))
        out.append(int(logits.argmax(dim=-1)))
    return "".join(vocab[i] for i in out)


if __name__ == "__main__":
    exit_without_finalizing(main(sys.argv[1:]))
