"""Images/s and MFU per GPU for resnet18, bf16, batch 256, channels_last: the step loop alone, and the steady epochs
of a real run with the trainer's defaults, eager and compiled (--compile), beside the published reference and the
goals; it ends through bench/bounds.py (exit 1 past a goal).

    .venv/bin/python bench/gpu_throughput.py                                  # on a GPU machine (make test-gpu runs it)
    .venv/bin/python bench/gpu_throughput.py --device cpu --steps 2 --batch-size 8 --model tiny --train-images 256

- Step loop: the trainer's own train_step (trainer/loop.py) on a model built as the trainer builds it
  (trainer/state.py: channels_last on CUDA, the trainer's optimizer and scaler, --compile's wrapper), on one fixed
  on-device batch, after warm-up steps (cuDNN's choice of algorithms, the compilation); timed between two device
  synchronisations.
- Real run: the trainer's own main (trainer/__main__.py) in this process on synthetic CIFAR-size data with the
  trainer's defaults (only the model, precision, batch size, epochs, device and --compile given). Three figures:
  the start (main's call to the first step of the second epoch: data, model, the first epoch with its autotuning
  and compilation), the steady epochs (from there to the final evaluation: the loop with whatever evaluations
  and checkpoints the defaults make, as images/s) and the end (the final evaluation and save). Only the steady
  images/s has a goal: the start and the end are fixed costs that a longer run spreads.
- FLOPs per image: forward and backward, counted once with torch.utils.flop_counter.FlopCounterMode. MFU: the
  images/s times that, over the GPU's dense bf16 peak (trainer/hardware.py's PEAK_TFLOPS).
- Goals (on a GPU): the step loop at least STEP_GOAL images/s on an H100 SXM, scaled by the GPU's peak for any
  other GPU in the table (an A100: 312/989 of it); the steady epochs at least WALL_GOAL of the step loop. With
  --device cpu it is a smoke run: its figures have no bound.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bounds  # noqa: E402  (bench/bounds.py: every benchmark ends through it)

from trainer import config, data, dist, loop, state  # noqa: E402
from trainer.__main__ import main as trainer_main  # noqa: E402
from trainer.device import check_device  # noqa: E402
from trainer.hardware import peak_tflops  # noqa: E402  (dense bf16 peaks by GPU name, one table)

# airbench's README: "standard ResNet-18 training: 96.0%, 7 min" on one A100 (torch 2.4), about 23k images/s.
REFERENCE = ("reference: airbench's published ResNet-18 run on one A100, ~23k images/s; an H100 should give "
             "~40-50k (an estimate, not a measurement)")
STEP_GOAL = 40_000.0  # images/s per GPU in the step loop, on an H100 SXM (989.4 dense bf16 TFLOPS)
STEP_GOAL_PEAK = 989.4  # the peak STEP_GOAL is for: other GPUs' goals scale by theirs
WALL_GOAL = 0.90  # the steady epochs' images/s as a fraction of the step loop's


@dataclass(frozen=True)
class Figures:
    step_ips: float  # images/s, step loop
    wall_ips: float  # images/s, the real run's steady epochs
    flops: float  # per image, forward + backward
    peak: float | None  # TFLOPS of this GPU (None: CPU or a GPU not in the table)
    start_s: float = 0.0  # the real run's start: main's call to the second epoch's first step
    end_s: float = 0.0  # the real run's end: its final evaluation and save


def step_goal(peak: float | None) -> float | None:
    """The step loop's goal on a GPU of this peak (None: no goal, a CPU or a GPU not in the table)."""
    return STEP_GOAL * peak / STEP_GOAL_PEAK if peak else None


def trainer_args(args: argparse.Namespace, data_dir: Path, ckpt_dir: Path, epochs: int, compile_: str = "off"
                 ) -> list[str]:
    """The trainer's command line: its defaults, except what this benchmark is about."""
    return ["--data-dir", str(data_dir), "--ckpt-dir", str(ckpt_dir), "--allow-unverified-data",
            "--model", args.model, "--precision", "bf16", "--batch-size", str(args.batch_size),
            "--device", args.device, "--epochs", str(epochs), "--compile", compile_]


def flops_per_image(st: state.TrainState, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward and backward of one batch, counted by torch (matmuls and convolutions), per image."""
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(st.model(x), y).backward()
    st.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(y)


def step_loop(cfg: config.Config, steps: int, warmup: int) -> tuple[float, float]:
    """(images/s of the trainer's train_step on one fixed batch, FLOPs per image)."""
    ctx = dist.context_from_env(cfg.device)
    check_device(cfg, ctx)
    st = state.build(cfg, ctx)
    state.wrap(cfg, ctx, st)  # --compile's wrapper (one process: no DDP)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch_size, 3, 32, 32, generator=gen).to(ctx.device)
    y = torch.randint(0, 10, (cfg.batch_size,), generator=gen).to(ctx.device)
    flops = flops_per_image(st, x[:2], y[:2])
    for _ in range(warmup):
        loop.train_step(st, x, y, cfg.lr, cfg.precision)
    _sync(ctx.device)
    start = time.perf_counter()
    for _ in range(steps):
        loop.train_step(st, x, y, cfg.lr, cfg.precision)
    _sync(ctx.device)
    return steps * cfg.batch_size / (time.perf_counter() - start), flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def real_run(args: argparse.Namespace, compile_: str) -> tuple[float, float, float]:
    """(start s, steady images/s, end s) of a real run: the clocks read by wrappers around the trainer's
    train_step and _evaluate, which the loop calls by name."""
    starts: list[float] = []
    evaluations: list[float] = []
    real_step, real_evaluate = loop.train_step, loop._evaluate

    def timed_step(*a: Any, **k: Any) -> torch.Tensor:
        starts.append(time.perf_counter())
        return real_step(*a, **k)

    def timed_evaluate(*a: Any, **k: Any) -> float:
        evaluations.append(time.perf_counter())
        return real_evaluate(*a, **k)

    per_epoch = args.train_images // args.batch_size
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as folder:
        data.write_synthetic(Path(folder) / "data", args.train_images, max(args.train_images // 5, 10))
        loop.train_step, loop._evaluate = timed_step, timed_evaluate
        begin = time.perf_counter()
        try:
            code = trainer_main(trainer_args(args, Path(folder) / "data", Path(folder) / "ckpt", args.epochs,
                                             compile_))
        finally:
            loop.train_step, loop._evaluate = real_step, real_evaluate
        end = time.perf_counter()
    if code != 0 or len(starts) <= per_epoch or not evaluations or evaluations[-1] < starts[-1]:
        raise SystemExit(f"error: the trainer's run ended with exit {code} after {len(starts)} steps ({per_epoch} "
                         "per epoch); give it at least 2 --epochs")
    steady_from, steady_to = starts[per_epoch], evaluations[-1]
    images = (len(starts) - per_epoch) * args.batch_size
    return steady_from - begin, images / (steady_to - steady_from), end - steady_to


def figures(mode: str, fig: Figures, on_gpu: bool) -> list[bounds.Figure]:
    """The step loop and the steady epochs against their goals; a CPU run (a smoke run) and a GPU without a known
    peak have no images/s goal."""
    goal = step_goal(fig.peak) if on_gpu else None
    step_baseline = (f"{STEP_GOAL:.0f} on an H100 SXM x this GPU's peak {fig.peak:g} / {STEP_GOAL_PEAK:g}"
                     if goal is not None else "no goal on this device (no peak known)")
    return [bounds.Figure(f"{mode} step loop", fig.step_ips, "images/s", step_baseline, goal or 0.0, True),
            bounds.Figure(f"{mode} steady epochs", fig.wall_ips / fig.step_ips, "x the step loop's images/s",
                          "the step loop", WALL_GOAL if on_gpu else 0.0, True)]


def report(mode: str, fig: Figures) -> list[str]:
    """The lines to print for one mode (eager or compiled): figures, MFU, start and end apart."""
    def mfu(ips: float) -> str:
        return f"MFU {ips * fig.flops / (fig.peak * 1e12):.1%}" if fig.peak else "MFU n/a (no peak for this device)"
    return [
        f"{mode}: step loop:     {fig.step_ips:10.0f} images/s  {mfu(fig.step_ips)}",
        f"{mode}: steady epochs: {fig.wall_ips:10.0f} images/s  {mfu(fig.wall_ips)}  "
        f"{fig.wall_ips / fig.step_ips:.0%} of the step loop",
        f"{mode}: start {fig.start_s:.1f} s (data, model, first epoch), end {fig.end_s:.1f} s (final evaluation and "
        "save)",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=100, help="timed steps of the step loop")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (cuDNN autotuning, compilation)")
    p.add_argument("--train-images", type=int, default=50_000, help="synthetic training set of the real run")
    p.add_argument("--epochs", type=int, default=5, help="of the real run (at least 2: the first is the start)")
    p.add_argument("--compile", default=None, choices=config.COMPILE_BACKENDS,
                   help="the compiled measurement's backend (default: inductor on CUDA, none on CPU); off: eager only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = args.device == "cuda"
    backend = args.compile if args.compile is not None else ("inductor" if on_gpu else "off")
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak = peak_tflops(name) if on_gpu else None
    print(f"gpu_throughput: {args.model}, bf16, batch {args.batch_size}, channels_last on CUDA, 1 process")
    print(f"device: {name}" + (f" (dense bf16 peak {peak:.0f} TFLOPS)" if peak else ""))
    measured: list[bounds.Figure] = []
    for mode, compile_ in (("eager", "off"), (f"compiled ({backend})", backend)):
        if compile_ == "off" and mode != "eager":
            continue
        cfg, _ = config.parse(trainer_args(args, REPO, REPO, args.epochs, compile_))  # the step loop reads no folder
        step_ips, flops = step_loop(cfg, args.steps, args.warmup)
        start_s, wall_ips, end_s = real_run(args, compile_)
        fig = Figures(step_ips, wall_ips, flops, peak, start_s, end_s)
        if mode == "eager":
            print(f"FLOPs per image (forward + backward, FlopCounterMode): {flops / 1e9:.3f} GFLOP")
        print("\n".join(report(mode, fig)), flush=True)
        measured += figures(mode, fig, on_gpu)
    print(REFERENCE)
    return bounds.finish(measured)


if __name__ == "__main__":
    sys.exit(main())
