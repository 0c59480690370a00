"""The learning rate at a large global batch: the trainer's rule (trainer/defaults.py, scaled_lr: linear up to
--lr-ref-batch, square root past it) against the linear rule it replaced, at 16 GPUs x 256 = 4096 images a step.

    PYTHONPATH=. python bench/lr_scale.py [--steps 72] [--global-batch 4096] [--micro-batch 1024]

Both runs take the trainer's own schedule for a GPU job of that global batch (defaults.resolve for "cuda",
loop.lr_at: a warm-up of 5 epochs of CIFAR-10's 50000 images, i.e. 60 steps of 4096, then the cosine), the
trainer's optimizer (SGD, Nesterov momentum 0.9, weight decay 5e-4) and gradient accumulation (micro-batches summed
into one step's gradient: what 16 GPUs' all-reduce would give). Only the lr differs: 0.4 by the square root, 1.6
by the linear rule. The data is hard to fit: noisy class templates (3x16x16 pixels, signal 0.3 of the noise)
with 30% of the labels random, so the gradients do not vanish before the peak lr is reached (the tests'
synthetic set is separable within a few steps). The model is a stand-in: a 3-layer MLP, since a CIFAR ResNet at
4096 images a step takes 20 s or more a step on this CPU. What a ResNet at this batch does on GPUs is for a GPU
run to show.

Exits 1 (bench/bounds.py) when the trainer's rule lets the loss rise more than RISE_BOUND above its first step's,
or ends no lower than it started; the linear rule's figures are printed as the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repo holds trainer/
from bounds import Figure, finish  # noqa: E402

from trainer import defaults, loop, optim  # noqa: E402
from trainer.config import LR_REF_BATCH, Config  # noqa: E402
from trainer.defaults import RunSettings  # noqa: E402

CIFAR_TRAIN = 50000  # images an epoch: the lr schedule counts epochs
RISE_BOUND = 0.1  # nats: the trainer's rule may not push the loss more than this above its first step's
POOL = 16384
FEATURES = 3 * 16 * 16
SIGNAL, NOISE = 0.45, 1.5  # per pixel: each class template at 0.3 of the noise


def hard_data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy class templates, 30% of the labels random: a loss that falls slowly from ln 10 and stays well
    above 0, so a high lr has gradients to act on for the whole run."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, FEATURES, generator=g)
    labels = torch.randint(0, 10, (POOL,), generator=g)
    images = SIGNAL * templates[labels] + NOISE * torch.randn(POOL, FEATURES, generator=g)
    noisy = torch.rand(POOL, generator=g) < 0.3
    return images, torch.where(noisy, torch.randint(0, 10, (POOL,), generator=g), labels)


def mlp() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights under both rules
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(cfg: Config, run: RunSettings, data: tuple[torch.Tensor, torch.Tensor], steps: int,
          micro: int) -> list[float]:
    """Each step's loss (the mean over its global batch), until the last step or the first non-finite one."""
    images, labels = data
    model = mlp()
    opt = optim.build(cfg, model.parameters())
    draw = torch.Generator().manual_seed(2)  # the same batches under both rules
    losses: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = loop.lr_at(run, (step + 1) * run.global_batch / CIFAR_TRAIN)
        idx = torch.randint(0, POOL, (run.global_batch,), generator=draw)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for part in idx.split(micro):  # gradient accumulation: the micro-batches' gradients add up
            loss = F.cross_entropy(model(images[part]), labels[part]) * (len(part) / run.global_batch)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
        if not math.isfinite(total):
            break
    return losses


def summary(name: str, run: RunSettings, losses: list[float], seconds: float) -> str:
    return (f"{name}: peak lr {run.lr:g}, warm-up {run.warmup_epochs:g} epochs; loss first {losses[0]:.3f}, "
            f"lowest {min(losses):.3f}, highest {max(losses):.3f}, last {losses[-1]:.3f} after {len(losses)} "
            f"steps ({seconds:.0f} s)")


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=72, help="steps of each run (72: the warm-up's 60, one epoch more)")
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1024, help="images per accumulated micro-batch")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = Config(data_dir=Path("."), ckpt_dir=Path("."))  # every option at its default: --lr 0.1, ref auto
    ours = defaults.resolve(cfg, "cuda", True, args.global_batch)  # the settings of a GPU job of this batch
    linear = dataclasses.replace(ours, lr=cfg.lr * args.global_batch / LR_REF_BATCH)
    data = hard_data()
    results = {}
    for name, run in (("square-root rule (the trainer's)", ours), ("linear rule (before)", linear)):
        t0 = time.perf_counter()
        results[name] = losses = train(cfg, run, data, args.steps, args.micro_batch)
        print(summary(name, run, losses, time.perf_counter() - t0), flush=True)
    new, old = results.values()
    old_rise = max(old) - old[0] if all(map(math.isfinite, old)) else math.inf
    new_rise = max(new) - new[0] if all(map(math.isfinite, new)) else math.inf
    baseline = f"linear rule lr {linear.lr:g}: {old_rise:+.3f} nats, last {old[-1]:.3f} (first {old[0]:.3f})"
    return finish([
        Figure(f"trainer's rule (lr {ours.lr:g}): highest loss above its first", new_rise, "nats", baseline,
               RISE_BOUND, False),
        Figure(f"trainer's rule (lr {ours.lr:g}): last loss against its first", new[-1] - new[0], "nats", baseline,
               0.0, False),
    ])


if __name__ == "__main__":
    sys.exit(main())
