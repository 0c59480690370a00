"""Memory per process and speed of DDP and FSDP on the larger model, and the cost of a sharded checkpoint.

    .venv/bin/python bench/fsdp_memory.py [--model vit-cifar] [--batch 8] [--steps 3]

One run, everything side by side, on CPU with gloo (real torchrun processes, one thread each):
- DDP and FSDP at 2 and 4 processes: parameter, gradient and optimizer bytes held per process after a step
  (trainer.parallel.memory: local shards only), and images/s over the steps after the first (random images);
- FSDP's sharded checkpoint (trainer.dcp_checkpoint, the trainer's own save): written by 2 processes, then
  loaded (resharded) by 3: the time of each and the folder's size on disk.
Each configuration is a torchrun of this same file with --worker, which prints one JSON line. Exits 1 when FSDP
holds more than MAX_SHARE of DDP's training state per process at N processes (1/N plus what does not divide
evenly; bench/bounds.py). The images/s and the checkpoint's seconds are printed, not bounded: on shared cores
they are the load's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MAX_SHARE = {2: 0.55, 4: 0.3}  # 1/N of DDP's state per process, plus 10% (or 5%) for what does not divide evenly

from bounds import Figure, finish  # noqa: E402

from trainer import dcp_checkpoint, dist, parallel, snapshot, state, strategies  # noqa: E402
from trainer.__main__ import exit_without_finalizing  # noqa: E402
from trainer.config import Config  # noqa: E402

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the worker: one configuration, under torchrun ---------------------------------------------------------------

def _worker(ns: argparse.Namespace) -> None:
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path(ns.ckpt_dir or "/unused"), model=ns.model,
                 strategy=ns.strategy, keep_checkpoints=1)
    ctx = dist.context_from_env("cpu")
    dist.init(ctx, 600)
    strategy = strategies.for_config(cfg)
    st = strategy.build(cfg, ctx)
    result: dict[str, float] = {}
    if ns.mode == "train":
        strategy.wrap(cfg, ctx, st)
        result["images_per_s"] = _train(st, ns.batch, ns.steps) * ctx.world_size
        mem = parallel.memory(st.model, st.optimizer)
        result.update(params=mem.params, grads=mem.grads, optimizer=mem.optimizer)
    elif ns.mode == "save":
        _train(st, 1, 1)  # gradients and momentum buffers exist, as in training
        dist.barrier(ctx)
        t0 = time.perf_counter()
        path = snapshot.save_sharded(cfg, ctx, st, 0)
        result["seconds"] = time.perf_counter() - t0
        result["bytes"] = sum(p.stat().st_size for p in path.iterdir())
    else:
        dist.barrier(ctx)
        t0 = time.perf_counter()
        dcp_checkpoint.restore(cfg, ctx, st.model, st.optimizer)
        result["seconds"] = time.perf_counter() - t0
    dist.barrier(ctx)
    if ctx.is_main:
        print(json.dumps(result))
    dist.shutdown()


def _train(st: state.TrainState, batch: int, steps: int) -> float:
    """Images/s of this process over the steps after the first (which allocates grads and optimizer state)."""
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        st.optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(st.ddp(x), y).backward()
        st.optimizer.step()
    return max(steps - 1, 1) * batch / (time.perf_counter() - t0)


# ---- the driver --------------------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit-cifar")
    p.add_argument("--batch", type=int, default=8, help="images per process and step")
    p.add_argument("--steps", type=int, default=3, help="training steps per configuration (the first is not timed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", default="", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        _worker(ns)
        exit_without_finalizing(0)  # gloo's threads outlive the group: SIGABRT at finalization otherwise
    common = ["--model", ns.model, "--batch", str(ns.batch), "--steps", str(ns.steps)]
    print(f"{ns.model}, batch {ns.batch} per process, CPU/gloo, one thread per process; MiB per process")
    print(f"{'strategy':8} {'procs':>5} {'params':>8} {'grads':>8} {'optim':>8} {'images/s':>9}")
    figures = []
    for nproc in (2, 4):
        held = {}
        for strategy in ("ddp", "fsdp"):
            r = _torchrun(nproc, [*common, "--strategy", strategy])
            print(f"{strategy:8} {nproc:5d} {_mib(r['params'])} {_mib(r['grads'])} {_mib(r['optimizer'])} "
                  f"{r['images_per_s']:9.1f}", flush=True)
            held[strategy] = r["params"] + r["grads"] + r["optimizer"]
        figures.append(Figure(f"FSDP's training state per process at {nproc} / DDP's", held["fsdp"] / held["ddp"],
                              "x", f"DDP {held['ddp'] / 2**20:.1f} MiB per process", MAX_SHARE[nproc], False))
    folder = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    try:
        ckpt = ["--strategy", "fsdp", "--ckpt-dir", str(folder), *common]
        saved = _torchrun(2, [*ckpt, "--mode", "save"])
        loaded = _torchrun(3, [*ckpt, "--mode", "load"])
        print(f"sharded checkpoint: saved by 2 processes in {saved['seconds']:.2f} s, {saved['bytes'] / 2**20:.1f} MiB "
              f"on disk; loaded (resharded) by 3 in {loaded['seconds']:.2f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return finish(figures)


if __name__ == "__main__":
    sys.exit(main())
