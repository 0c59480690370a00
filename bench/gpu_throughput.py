"""Images/s and MFU per GPU for resnet18, bf16, batch 256, channels_last: the step loop alone, and the wall clock
of a real run with the trainer's defaults, beside the published reference and the goals.

    .venv/bin/python bench/gpu_throughput.py                                  # on a GPU machine (make test-gpu runs it)
    .venv/bin/python bench/gpu_throughput.py --device cpu --steps 2 --batch-size 8 --model tiny --train-images 256

- Step loop: the trainer's own train_step (trainer/loop.py) on a model built as the trainer builds it
  (trainer/state.py: channels_last on CUDA, the trainer's optimizer and scaler), on one fixed on-device batch,
  after warm-up steps (cuDNN's choice of algorithms); timed between two device synchronisations.
- Wall clock: the trainer's own main (trainer/__main__.py) in this process on synthetic CIFAR-size data with the
  trainer's defaults (only the model, precision, batch size, epochs and device given): the images of every step
  after the warm-up ones over the time from that step's start to the run's end, so each epoch's evaluation and
  checkpoint (whatever the defaults say) and the final save are inside, the imports and data load are not.
- FLOPs per image: forward and backward, counted once with torch.utils.flop_counter.FlopCounterMode. MFU: the
  images/s times that, over the GPU's dense bf16 peak (trainer/hardware.py's PEAK_TFLOPS).
On a GPU the exit code is 1 when a goal is missed (GOALS); with --device cpu it is a smoke run (exit 0).
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

from trainer import config, data, dist, loop, state  # noqa: E402
from trainer.__main__ import main as trainer_main  # noqa: E402
from trainer.device import check_device  # noqa: E402
from trainer.hardware import peak_tflops  # noqa: E402  (dense bf16 peaks by GPU name, one table)

# airbench's README: "standard ResNet-18 training: 96.0%, 7 min" on one A100 (torch 2.4), about 23k images/s.
REFERENCE = ("reference: airbench's published ResNet-18 run on one A100, ~23k images/s; an H100 should give "
             "~40-50k (an estimate, not a measurement)")
STEP_GOAL = 40_000.0  # images/s per GPU in the step loop, on an H100 or H200
WALL_GOAL = 0.90  # the wall clock's images/s as a fraction of the step loop's


@dataclass(frozen=True)
class Figures:
    step_ips: float  # images/s, step loop
    wall_ips: float  # images/s, wall clock of a real run
    flops: float  # per image, forward + backward
    peak: float | None  # TFLOPS of this GPU (None: CPU or a GPU not in the table)


def trainer_args(args: argparse.Namespace, data_dir: Path, ckpt_dir: Path, epochs: int) -> list[str]:
    """The trainer's command line: its defaults, except what this benchmark is about."""
    return ["--data-dir", str(data_dir), "--ckpt-dir", str(ckpt_dir), "--allow-unverified-data",
            "--model", args.model, "--precision", "bf16", "--batch-size", str(args.batch_size),
            "--device", args.device, "--epochs", str(epochs)]


def flops_per_image(st: state.TrainState, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward and backward of one batch, counted by torch (matmuls and convolutions), per image."""
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(st.ddp(x), y).backward()
    st.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(y)


def step_loop(cfg: config.Config, steps: int, warmup: int) -> tuple[float, float]:
    """(images/s of the trainer's train_step on one fixed batch, FLOPs per image)."""
    ctx = dist.context_from_env(cfg.device)
    check_device(cfg, ctx)
    st = state.build(cfg, ctx)
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


def wall_clock(args: argparse.Namespace, warmup: int) -> float:
    """Images/s of a real run, from the start of its step `warmup` (its clock read by a wrapper around the
    trainer's train_step, which the loop calls by name) to the end of the run."""
    starts: list[float] = []
    real_step = loop.train_step

    def timed(*a: Any, **k: Any) -> torch.Tensor:
        starts.append(time.perf_counter())
        return real_step(*a, **k)

    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as folder:
        data.write_synthetic(Path(folder) / "data", args.train_images, max(args.train_images // 5, 10))
        loop.train_step = timed
        try:
            code = trainer_main(trainer_args(args, Path(folder) / "data", Path(folder) / "ckpt", args.epochs))
        finally:
            loop.train_step = real_step
        end = time.perf_counter()
    if code != 0 or len(starts) <= warmup:
        raise SystemExit(f"error: the trainer's run ended with exit {code} after {len(starts)} steps; "
                         "give it more --epochs or --train-images")
    return (len(starts) - warmup) * args.batch_size / (end - starts[warmup])


def report(name: str, fig: Figures, on_gpu: bool) -> list[str]:
    """The lines to print; the misses (goal lines) are those that end in 'MISSED'."""
    def mfu(ips: float) -> str:
        return f"MFU {ips * fig.flops / (fig.peak * 1e12):.1%}" if fig.peak else "MFU n/a (no peak for this device)"
    fast_gpu = any(k in name for k in ("H100", "H200"))
    step_ok = fig.step_ips >= STEP_GOAL or not fast_gpu
    wall_ok = fig.wall_ips >= WALL_GOAL * fig.step_ips
    goal = f"goal >= {STEP_GOAL:.0f} on H100/H200" if fast_gpu else "goal: none for this device"
    return [
        f"device: {name}" + (f" (dense bf16 peak {fig.peak:.0f} TFLOPS)" if fig.peak else ""),
        f"FLOPs per image (forward + backward, FlopCounterMode): {fig.flops / 1e9:.3f} GFLOP",
        f"step loop:  {fig.step_ips:10.0f} images/s  {mfu(fig.step_ips)}  {goal}"
        + ("" if step_ok or not on_gpu else "  MISSED"),
        f"wall clock: {fig.wall_ips:10.0f} images/s  {mfu(fig.wall_ips)}  "
        f"{fig.wall_ips / fig.step_ips:.0%} of the step loop, goal >= {WALL_GOAL:.0%}"
        + ("" if wall_ok or not on_gpu else "  MISSED"),
        REFERENCE,
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=100, help="timed steps of the step loop")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (cuDNN autotuning)")
    p.add_argument("--train-images", type=int, default=50_000, help="synthetic training set of the real run")
    p.add_argument("--epochs", type=int, default=5, help="of the real run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, _ = config.parse(trainer_args(args, REPO, REPO, args.epochs))  # the step loop reads no folder
    step_ips, flops = step_loop(cfg, args.steps, args.warmup)
    on_gpu = args.device == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    fig = Figures(step_ips, wall_clock(args, args.warmup), flops, peak_tflops(name) if on_gpu else None)
    print(f"gpu_throughput: {args.model}, bf16, batch {args.batch_size}, channels_last on CUDA, 1 process")
    lines = report(name, fig, on_gpu)
    print("\n".join(lines), flush=True)
    return 1 if any(line.endswith("MISSED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
