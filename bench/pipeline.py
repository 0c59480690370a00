"""Pipeline parallelism (--pp) on CPU with gloo: the step against its bubble bound, the automatic split against the
uniform one, 1F1B against GPipe in memory, and pipelining against plain DDP at the same global batch.

    .venv/bin/python bench/pipeline.py [--model resnet20-gn] [--batch 32] [--steps 6]

Each configuration is a torchrun of this file with --worker (2 processes, one thread each, --batch images per
process: the global batch is the same in every one), which prints one JSON line from global rank 0:
- ddp: 2 replicas of the whole model;
- pp2 1f1b auto / uniform, pp2 gpipe auto: 2 stages x 1 replica, 4 x pp micro-batches.
Figures (bench/bounds.py; exit 1 past a bound):
- step / bubble bound: the measured step over (m+p-1) x the slowest stage's time per micro-batch (each block's
  forward+backward measured alone, plus the transfers at the stage's cuts over the link measured between the two
  processes, trainer/pipeline.py): at most 1.15 (issue 42);
- the auto split's slowest stage, as a share of the uniform split's: below 1 (a CIFAR ResNet's blocks are uneven);
- GPipe's peak memory over 1F1B's, per process (ru_maxrss): at least 1 (GPipe keeps every micro-batch's
  activations until backward, 1F1B at most p);
- pipelining's images/s over DDP's: at most 1, the plain statement that when the model fits on one device
  pipelining loses: each process runs half the model on the whole batch, in micro-batches that use the core less
  well, and idles in the bubble; DDP runs the whole model on half the batch and only all-reduces gradients.
pp=4 is not run: 4 processes on this machine's 2 shared cores would measure the cores, not the schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

from trainer import dist, models, pipeline, strategies  # noqa: E402
from trainer.__main__ import exit_without_finalizing  # noqa: E402
from trainer.config import parse, pp_microbatches  # noqa: E402

torch.set_num_threads(1)
BUBBLE_SLACK = 1.15

CONFIGS = {  # name: trainer options beyond the model and batch
    "ddp": [],
    "pp2-1f1b-auto": ["--pp", "2"],
    "pp2-1f1b-uniform": ["--pp", "2", "--pp-split", "uniform"],
    "pp2-gpipe-auto": ["--pp", "2", "--pp-schedule", "gpipe"],
}


def worker(model: str, batch: int, steps: int, extra: list[str]) -> None:

    cfg, _ = parse(["--data-dir", "/unused", "--ckpt-dir", "/unused", "--model", model, "--batch-size", str(batch),
                    "--precision", "fp32", "--device", "cpu", *extra])
    ctx = dist.context_from_env("cpu")
    dist.init(ctx, 300)
    strategy = strategies.for_config(cfg)
    st = strategy.build(cfg, ctx)
    strategy.wrap(cfg, ctx, st)
    _, shares = strategy.data_share(ctx)
    n = batch * ctx.world_size // shares
    x, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    times = []
    for i in range(steps + 1):
        dist.barrier(ctx)
        t0 = time.perf_counter()
        strategy.train_step(st, x, y, 0.01, "fp32", 0, contextlib.nullcontext)
        dist.barrier(ctx)
        if i:  # the first step pays for the stages' shape exchange and the first allocations
            times.append(time.perf_counter() - t0)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    links = pipeline.measure_links(ctx, cfg.pp, 1, cfg.pp, getattr(strategy, "pp_group")) if cfg.pp > 1 else []  # noqa: B009
    if ctx.is_main:
        out = {"step_s": statistics.median(times), "images_per_s": batch * ctx.world_size / statistics.median(times),
               "peak_rss": float(peak)}
        if cfg.pp > 1:  # every split's stages weighed alike, after training: compute and the transfers at its cuts
            torch.manual_seed(cfg.seed)
            measured = pipeline.profile(models.build(model), n // pp_microbatches(cfg), ctx.device)
            costs = pipeline.StageCosts(measured.seconds, measured.out_bytes, links)
            split = getattr(strategy, "split")  # noqa: B009
            out |= {"split": split, "stage_s": costs.per_stage(split, costs.seconds),
                    "transfer_s": costs.per_stage(split, costs.transfer_s), "link_bps": links,
                    "microbatches": pp_microbatches(cfg), "uniform_stage_s": costs.per_stage(
                        pipeline.uniform_split(len(costs.compute_s), cfg.pp), costs.seconds)}
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier(ctx)
    exit_without_finalizing(0)


def run(name: str, ns: argparse.Namespace, port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, "--worker", "--model", ns.model, "--batch", str(ns.batch),
           "--steps", str(ns.steps), "--", *CONFIGS[name]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20-gn")
    parser.add_argument("--batch", type=int, default=32, help="images per process")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("extra", nargs="*")
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.model, ns.batch, ns.steps, ns.extra)
        return 0
    r = {name: run(name, ns, 29600 + i) for i, name in enumerate(CONFIGS)}
    auto, uniform, gpipe, ddp = r["pp2-1f1b-auto"], r["pp2-1f1b-uniform"], r["pp2-gpipe-auto"], r["ddp"]
    p, m = 2, auto["microbatches"]
    figures = [
        Figure(f"{name} step / bubble bound (m={m}, p={p})", res["step_s"] / ((m + p - 1) * max(res["stage_s"])),
               "x", f"(m+p-1)/m x slowest stage = {(m + p - 1) * max(res['stage_s']):.3f} s", BUBBLE_SLACK, False)
        for name, res in (("pp2 1f1b auto", auto), ("pp2 1f1b uniform", uniform))
    ] + [
        Figure(f"auto split {auto['split']}: slowest stage / uniform's", max(auto["stage_s"]) /
               max(auto["uniform_stage_s"]), "x", f"uniform {uniform['split']}: "
               f"{max(auto['uniform_stage_s']) / sum(auto['uniform_stage_s']):.0%} of the model in its slowest stage, "
               f"auto {max(auto['stage_s']) / sum(auto['stage_s']):.0%}", 1.0, False),
        Figure("auto split images/s / uniform's", auto["images_per_s"] / uniform["images_per_s"], "x",
               f"uniform {uniform['images_per_s']:.0f} images/s, auto {auto['images_per_s']:.0f}", 1.0, True),
        Figure("GPipe peak memory / 1F1B's (per process)", gpipe["peak_rss"] / auto["peak_rss"], "x",
               f"1F1B {auto['peak_rss'] / 2**20:.0f} MiB, GPipe {gpipe['peak_rss'] / 2**20:.0f} MiB", 1.0, True),
        Figure("pp2 x dp1 images/s / DDP's at the same global batch", auto["images_per_s"] / ddp["images_per_s"],
               "x", f"DDP x2 {ddp['images_per_s']:.0f} images/s; pipelining loses when the model fits", 1.0, False),
    ]
    return finish(figures)


if __name__ == "__main__":
    sys.exit(main())
