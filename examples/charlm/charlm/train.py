"""A character-level language model on a text file from DATA_DIR, trained with DDP under `up --entry`.

Run it: put the text at <data dir>/<--text> on every node, then
  python -m orchestrate up --hosts hosts.txt --gpus 0 --image ddp-example-charlm \
      --entry '-m charlm.train' -- --steps 200 --text input.txt
The model sees --context characters and predicts the next (embedding → MLP). Each rank draws its own
windows; DDP averages the gradients. Rank 0 checkpoints by the manifest convention (with the vocabulary),
SIGTERM checkpoints and exits 143, RESUME=1 continues from the newest valid checkpoint.

--tp N: tensor parallelism on a 2-D mesh (dp = world // N, tp = N). The MLP is Megatron's pair: its first linear
column-wise (each tp rank holds hidden/N output units), its second row-wise (the partial sums all-reduced), so
tanh runs on the local units with no collective between them; then fully_shard (FSDP2) over dp. The N ranks of
one tp group work on the same windows (drawn by dp rank), so the run trains exactly like DDP over dp ranks.
Checkpoints hold the full, gathered state dict (any dp x tp, or no --tp, resumes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from example_ckpt import EXIT_STOPPED, StopFlag, exit_without_finalizing, join_group, load_newest, save
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

# Megatron's MLP split: mlp.1 column-wise, tanh on each rank's own hidden units, mlp.3 row-wise (all-reduce).
TP_PLAN = {"mlp.1": ColwiseParallel, "mlp.3": RowwiseParallel}
# The full state dict, gathered to rank 0 on the CPU (the other ranks get empty dicts): a layout-free checkpoint.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CharModel(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Flatten(), nn.Linear(context * dim, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x))


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="input.txt", help="text file, relative to DATA_DIR")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--context", type=int, default=8, help="characters the model sees")
    p.add_argument("--batch-size", type=int, default=64, help="windows per rank and step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch or stop it)")
    p.add_argument("--log-every", type=positive, default=10, help="print the loss every N steps")
    p.add_argument("--tp", type=positive, default=1,
                   help="tensor-parallel degree N: a (world/N) x N mesh, TP on the MLP, FSDP over dp; 1: DDP")
    return p.parse_args(argv)


def build(vocab: int, context: int, device: torch.device, tp: int) -> nn.Module:
    """DDP when tp is 1; else TP_PLAN on the mesh's tp dim, then fully_shard over its dp dim. Every rank builds
    the same seeded weights; parallelize_module and fully_shard keep each rank's slice of them."""
    torch.manual_seed(0)
    model = CharModel(vocab, context).to(device)
    if tp == 1:
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {name: style() for name, style in TP_PLAN.items()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def layout(model: nn.Module) -> dict[str, dict[str, object]]:
    """How each TP linear's weight lies: its mesh dims, placements, and this rank's and the global shape."""
    out: dict[str, dict[str, object]] = {}
    for name in TP_PLAN:
        weight = model.get_submodule(name).weight
        if isinstance(weight, DTensor):
            out[f"{name}.weight"] = {"mesh": list(weight.device_mesh.mesh_dim_names or ()),
                                     "placements": [repr(p) for p in weight.placements],
                                     "local": list(weight.to_local().shape), "global": list(weight.shape)}
    return out


def refusal(state: dict[str, Any], vocab: list[str]) -> str | None:
    """Why a checkpoint cannot be resumed here, or None."""
    if state["vocab"] != vocab:
        return "the text's characters differ from the checkpoint's"
    if any(not isinstance(key, str) for key in state["optimizer"]["state"]):
        # get_state_dict keys the optimizer state by parameter name; torch's own state_dict (before --tp) by index.
        return "the checkpoint is from charlm before --tp (optimizer state by index, not by name)"
    return None


def main(argv: list[str]) -> int:
    args = parse(argv)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env % args.tp:
        print(f"error: --tp {args.tp} does not divide the {world_env} processes (WORLD_SIZE); give a divisor of it",
              file=sys.stderr)
        return 2
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

    model = build(len(vocab), args.context, device, args.tp)
    if args.tp > 1 and rank == 0:
        print("LAYOUT " + json.dumps(layout(model)), flush=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if os.environ.get("RESUME") == "1":
        box = [load_newest(os.environ["CKPT_DIR"]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device)
        if box[0] is not None:
            refused = refusal(box[0], vocab)
            if refused:
                print(f"error: {refused}; start without --resume", file=sys.stderr)
                return 2
            # Every rank has the full state; set_state_dict keeps its own shards of it (DDP: all of it).
            set_state_dict(model, opt, model_state_dict=box[0]["model"], optim_state_dict=box[0]["optimizer"],
                           options=StateDictOptions(full_state_dict=True))
            step = int(box[0]["step"])
        print(f"resumed at step {step}", flush=True)

    def checkpoint(done: bool) -> None:
        model_state, opt_state = get_state_dict(model, opt, options=FULL_STATE)  # a gather: every rank takes part
        if rank == 0:
            save(os.environ["CKPT_DIR"], {"model": model_state, "optimizer": opt_state, "step": step, "vocab": vocab},
                 step, epoch=int(done), epoch_complete=done, world_size=world)

    # By dp rank: the ranks of one tp group must see the same windows (ColwiseParallel takes its input as
    # replicated and never checks). The mesh is row-major, so the dp rank is rank // tp.
    dp_rank, dp_size = rank // args.tp, world // args.tp
    gen = torch.Generator().manual_seed(step * dp_size + dp_rank)
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
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.ckpt_every == 0:
            checkpoint(done=False)
        time.sleep(args.step_seconds)
    checkpoint(done=True)
    generated = sample(model, vocab, text[:args.context], 60)  # every rank: the TP/FSDP forward has collectives
    if rank == 0:
        print(f"sample: {generated!r}", flush=True)
        print(f"DONE step={step} loss={loss.item():.4f}", flush=True)
    dist.barrier()  # every rank done before any tears its group down (gloo can abort the early one)
    dist.destroy_process_group()
    return 0


@torch.no_grad()
def sample(model: nn.Module, vocab: list[str], prompt: str, n: int) -> str:
    out = [vocab.index(ch) for ch in prompt]
    context = len(prompt)
    for _ in range(n):
        logits = model(torch.tensor([out[-context:]], device=next(model.parameters()).device))
        out.append(int(logits.argmax(dim=-1)))
    return "".join(vocab[i] for i in out)


if __name__ == "__main__":
    exit_without_finalizing(main(sys.argv[1:]))
