"""What the per-rank step timing costs: images/s of the same 2-process CPU training with it and without it,
interleaved round by round in ONE process group, so that the machine's load hits both alike.

    .venv/bin/python bench/rank_timing.py [--model resnet20] [--pairs 40] [--bound 0.05]

Separate runs cannot show it on a loaded machine: runs of one arm differed by a factor of 2-4 here (a 186 vs 303
images/s median, pair ratios 0.52-1.02). So one torchrun (2 processes, gloo) trains one DDP model on batches held
in memory and alternates short rounds: each round is AGREE_EVERY steps ending in the trainer's agreement
(dist.agree), timed on rank 0 from one agreement to the next; a pair is one round with the timing as the trainer
does it (trainer/loop.py: RankTimer's timed fetch and forward, its figures in the agreement, rank 0's straggler
scores in metrics.Heartbeat.ranks) and one without (DDP_CIFAR_RANK_TIMING=0: no timer, an agreement without
times), the order swapped every pair (ABBA), the first pairs left out (warm-up). A load change between two
rounds seconds apart is rare and hits either arm first as often.

Reported: each arm's images/s over its rounds (median and interquartile range), the pairs' with/without ratios
(median, interquartile range, and the 95% confidence interval of the median from order statistics), and, beside
them, the timer's own work per step measured alone (timeit, no model). The script exits 1 when the median ratio
is below 1 - bound (--bound, default 5% of images/s): the figure of the whole training that the timing can slow.
5%: on the shared 2-core machine (load 10-18) the median's 95% interval spanned 6-14 points with 40 pairs, and the
median itself fell 1.6-3% from 1; a tighter bound needs more pairs or a quieter machine. The timer's own work is
printed, not bounded: timed without a model it is a few microseconds (0.002% of a step) and could never come near
any bound worth setting; a cost it missed would show in the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

from trainer import dist, metrics, models  # noqa: E402
from trainer.pace import AGREE_EVERY  # noqa: E402
from trainer.ranktime import FIELDS, RankTimer  # noqa: E402

RESULT_ENV = "RANK_TIMING_RESULT"  # where rank 0 writes its rounds (the worker's output to the parent)


def train_round(ctx: dist.DistContext, model: torch.nn.Module, opt: torch.optim.Optimizer,
                batches: list[tuple[torch.Tensor, torch.Tensor]], timer: RankTimer | None,
                beat: metrics.Heartbeat) -> float:
    """AGREE_EVERY steps as trainer/loop.py runs them, ending in the agreement; seconds from the last one."""
    start = time.perf_counter()
    loss = torch.zeros(())
    for x, y in timer.batches(batches) if timer else batches:
        opt.zero_grad(set_to_none=True)
        with timer.forward() if timer else contextlib.nullcontext():
            out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
    agreed = dist.agree(ctx, loss.detach(), False, False, times=timer.send() if timer else ())
    if timer:
        beat.ranks(timer.window_done(agreed.times), ctx.local_world_size)
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    """One process of the torchrun: rounds with and without the timing, alternating; rank 0 writes them out."""
    ctx = dist.context_from_env("cpu")
    dist.init(ctx, 300.0)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(models.build(args.model))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [(torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,)))
               for _ in range(AGREE_EVERY)]
    timer = RankTimer(torch.device("cpu"), ctx.world_size)
    beat = metrics.Heartbeat(Path(tempfile.gettempdir()), ctx.is_main, 1, 1, args.batch_size * ctx.world_size)
    rounds: dict[str, list[float]] = {"with": [], "without": []}
    for pair in range(args.warmup + args.pairs):
        for timed in (True, False) if pair % 2 == 0 else (False, True):
            took = train_round(ctx, model, opt, batches, timer if timed else None, beat)
            if pair >= args.warmup:
                rounds["with" if timed else "without"].append(took)
    if ctx.is_main:
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(rounds))
    dist.shutdown()


def run_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    """The torchrun of 2 worker processes; each arm's round seconds, in pair order."""
    with tempfile.TemporaryDirectory(prefix="rank-timing-") as folder:
        result = Path(folder) / "rounds.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", RESULT_ENV: str(result),
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(args.port), __file__, "--worker",
               "--model", args.model, "--batch-size", str(args.batch_size), "--pairs", str(args.pairs),
               "--warmup", str(args.warmup)]
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"error: the benchmark's torchrun failed (exit {done.returncode}); its output:\n"
                             f"{done.stdout[-3000:]}")
        rounds: dict[str, list[float]] = json.loads(result.read_text())
        return rounds


def timer_cost_s(steps: int = 20_000) -> float:
    """The timer's own work per step, alone (no model), the best of 5 timeit repeats: a timed fetch, a timed
    forward and one window's close per AGREE_EVERY steps."""
    def steps_of_timer() -> None:
        timer = RankTimer(torch.device("cpu"), 2)
        for i, _ in enumerate(timer.batches(range(steps))):
            with timer.forward():
                pass
            if i % AGREE_EVERY == 0:
                timer.window_done([0.1] * (2 * FIELDS))
    return min(timeit.repeat(steps_of_timer, number=1, repeat=5)) / steps


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, mid, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, mid, q3


def median_ci(values: list[float]) -> tuple[float, float]:
    """The 95% confidence interval of the median, distribution-free: the order statistics at n/2 -+ 0.98 sqrt(n)
    (the binomial's normal approximation)."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * math.sqrt(n)
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half) - 1)]


def report(args: argparse.Namespace, rounds: dict[str, list[float]], cost_s: float) -> tuple[list[str], list[Figure]]:
    """The lines printed, and the figure held to the bound (bench/bounds.py): the interleaved images/s ratio."""
    lines = list(_lines(args, rounds, cost_s))
    speed = _speed(args, rounds)
    mid = quartiles([a / b for a, b in zip(speed["with"], speed["without"], strict=True)])[1]
    return lines, [Figure("images/s with the per-rank timing / without, median of the pairs", mid, "x",
                          "without the timing: 1.0x", 1 - args.bound, True)]


def _speed(args: argparse.Namespace, rounds: dict[str, list[float]]) -> dict[str, list[float]]:
    images = args.batch_size * 2 * AGREE_EVERY
    return {arm: [images / s for s in rounds[arm]] for arm in ("with", "without")}


def _lines(args: argparse.Namespace, rounds: dict[str, list[float]], cost_s: float) -> Iterator[str]:
    speed = _speed(args, rounds)
    yield (f"rank_timing: {args.model}, 2 processes (CPU, gloo), batch {args.batch_size}/process, {args.pairs} pairs "
           f"of {AGREE_EVERY}-step rounds interleaved in one process group ({args.warmup} warm-up pairs left out)")
    for arm, label in (("with", "with per-rank timing   "), ("without", "without per-rank timing")):
        q1, mid, q3 = quartiles(speed[arm])
        yield f"{label}: median {mid:6.1f} images/s, interquartile {q1:.1f}-{q3:.1f}"
    ratios = [a / b for a, b in zip(speed["with"], speed["without"], strict=True)]
    q1, mid, q3 = quartiles(ratios)
    low, high = median_ci(ratios)
    yield f"with/without, pair by pair: median {mid:.3f}, interquartile {q1:.3f}-{q3:.3f}, 95% CI of the median " \
          f"{low:.3f}-{high:.3f}"
    step_s = args.batch_size * 2 / statistics.median(speed["without"])
    yield f"the timer's own work: {cost_s * 1e6:.1f} us per step, {cost_s / step_s:.4%} of a {step_s * 1e3:.0f} ms step"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--pairs", type=int, default=40, help="rounds with and without the timing, alternating")
    p.add_argument("--warmup", type=int, default=3, help="pairs run first and left out")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--bound", type=float, default=0.05, help="largest cost allowed, a fraction of images/s")
    p.add_argument("--port", type=int, default=29531, help="the torchrun's rendezvous port")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one process of the torchrun
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    lines, figures = report(args, run_rounds(args), timer_cost_s())
    print("\n".join(lines))
    return finish(figures)


if __name__ == "__main__":
    sys.exit(main())
