"""What a run does where an option was left at "auto": resolved once at start from the Config and the device.

The Config keeps what the user wrote ("auto" included, and that is what checkpoints save), so a resume on other
hardware resolves again; the loop reads the resolved `RunSettings`. An option the user gives always wins. The
defaults differ on a GPU because there the per-epoch work dominates: at 16 GPUs x 256 an epoch of CIFAR-10 is
12 steps, about 0.1 s of GPU work, against a synchronous checkpoint and a full evaluation after each one
(docs/gpu-nodes.md "GPU defaults"). On the CPU the step itself dominates, and every default is the old one.

Standard library only, like config.py: a pure function of its arguments, tested without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import LR_REF_BATCH, Config

SCALED_WARMUP_EPOCHS = 5.0
"""Warmup when the rule raises the lr (Goyal et al. 2017: 5 epochs), at most half the run."""
GPU_CKPT_EVERY_MINUTES = 5.0
"""A failure loses at most this much work; an asynchronous save pauses training only for the copy to the CPU."""
GPU_EVAL_EVERY_MINUTES = 1.0
"""A full evaluation costs about a tenth of an epoch's GPU work, and one host sync; once a minute is noise."""


@dataclass(frozen=True)
class RunSettings:
    """What the loop reads: every "auto" of the Config made concrete for this device and global batch."""

    precision: str
    global_batch: int
    """The global batch the lr was scaled for."""
    lr: float
    """Peak learning rate after the batch rule, scaled_lr (what lr_at warms up to, then decays)."""
    warmup_epochs: float
    epochs: int
    ckpt_every: int
    """Epochs between checkpoints; 0: not by epoch."""
    ckpt_every_s: float
    """Seconds between checkpoints, mid-epoch if need be; 0: not by time."""
    ckpt_async: bool
    eval_every: int
    """Epochs between evaluations; 0: not by epoch (the last epoch is always evaluated)."""
    eval_every_s: float
    """Seconds between evaluations, at an epoch's end; 0: not by time."""
    why: tuple[str, ...]
    """One phrase per setting: the value and where it came from, for the first log line."""

    def describe(self) -> str:
        return "settings: " + "; ".join(self.why)


def resolve(cfg: Config, device_type: str, bf16_fast: bool, global_batch: int) -> RunSettings:
    """`device_type`: "cuda" or "cpu"; `bf16_fast`: the GPU has bf16 tensor cores (compute capability >= 8)."""
    gpu = device_type == "cuda"
    precision, why_precision = resolve_precision(cfg.precision, device_type, bf16_fast)
    lr, warmup, why_lr = _lr(cfg, gpu, global_batch)
    ckpt_every, ckpt_s, ckpt_async, why_ckpt = _checkpoints(cfg, gpu)
    eval_every, eval_s, why_eval = _evaluation(cfg, gpu)
    return RunSettings(precision, global_batch, lr, warmup, cfg.epochs, ckpt_every, ckpt_s, ckpt_async, eval_every, eval_s,
                       (why_precision, why_lr, why_ckpt, why_eval))


def resolve_precision(given: str, device_type: str, bf16_fast: bool) -> tuple[str, str]:
    """bf16 on a GPU with bf16 tensor cores: fp32's range (no loss scale), half the bytes, the tensor cores'
    rate. fp32 on the CPU, where bf16 autocast is slower than fp32 for these models, and on an older GPU,
    where bf16 is emulated (fp16 would need the loss scaler: the user chooses it)."""
    if given != "auto":
        return given, f"precision {given} (given)"
    if device_type == "cuda" and bf16_fast:
        return "bf16", "precision bf16 (auto: a GPU with bf16 tensor cores)"
    if device_type == "cuda":
        return "fp32", "precision fp32 (auto: this GPU has no bf16 tensor cores; --precision fp16 is faster)"
    return "fp32", "precision fp32 (auto: CPU)"


def scaled_lr(lr: float, global_batch: int, ref: int) -> float:
    """`lr` is the rate for a global batch of `ref`: linear below it (Goyal et al. 2017), square root above it
    (Krizhevsky 2014, "One weird trick"; Hoffer et al. 2017, "Train longer, generalize better"). The linear rule
    was shown on ImageNet up to 8k images over 90 epochs (hundreds of warm-up steps) with zero-initialised last
    BN gammas; CIFAR-10 at 16 x 256 has 12 steps an epoch and none of that, and its 1.6 drove the loss back above
    its start where the square root's 0.4 did not (bench/lr_scale.py, docs/trainer.md). PURE."""
    ratio = global_batch / ref
    return lr * (ratio if ratio <= 1 else math.sqrt(ratio))


def _lr(cfg: Config, gpu: bool, global_batch: int) -> tuple[float, float, str]:
    """The batch rule (scaled_lr): --lr is the rate for a global batch of --lr-ref-batch. Auto: ref 256 on a GPU;
    on the CPU --lr is used as given (the tests' and the demo's CPU runs keep their meaning). Warmup auto: 1 epoch,
    or 5 when the rule raises the lr (at most half the run, at least 1)."""
    ref = cfg.lr_ref_batch if cfg.lr_ref_batch is not None else (LR_REF_BATCH if gpu else 0)
    lr = scaled_lr(cfg.lr, global_batch, ref) if ref else cfg.lr
    origin = "given" if cfg.lr_ref_batch is not None else "auto"
    how = "linear" if global_batch <= ref else "square root"
    rule = (f"{cfg.lr:g} x {'' if how == 'linear' else 'sqrt of '}global batch {global_batch} / {ref}, {how} rule, "
            f"ref {origin}" if ref else
            f"--lr as given, {'no scaling given' if origin == 'given' else 'auto: no scaling on CPU'}")
    if cfg.warmup_epochs is not None:
        warmup, warm_origin = cfg.warmup_epochs, "given"
    else:
        warmup = max(1.0, min(SCALED_WARMUP_EPOCHS, cfg.epochs / 2)) if lr > cfg.lr else 1.0
        warm_origin = "auto"
    return lr, warmup, f"lr {lr:g} ({rule}), warmup {warmup:g} epochs ({warm_origin})"


def _checkpoints(cfg: Config, gpu: bool) -> tuple[int, float, bool, str]:
    """GPU: every 5 minutes, not per epoch, asynchronous (the copy to the CPU is the only pause). CPU: every
    epoch, synchronous (a background writer would take a core from training, and the copy is the whole state)."""
    every = cfg.ckpt_every if cfg.ckpt_every is not None else (0 if gpu else 1)
    minutes = cfg.ckpt_every_minutes if cfg.ckpt_every_minutes is not None else (GPU_CKPT_EVERY_MINUTES if gpu else 0.0)
    asynchronous = cfg.ckpt_async == "on" or (cfg.ckpt_async == "auto" and gpu)
    parts = [f"every {every} epochs" if every else "", f"every {minutes:g} min" if minutes else ""]
    given = {"epochs": cfg.ckpt_every is not None, "minutes": cfg.ckpt_every_minutes is not None,
             "mode": cfg.ckpt_async != "auto"}
    return every, minutes * 60, asynchronous, (
        f"checkpoints {' and '.join(p for p in parts if p) or 'only at the end'} "
        f"{'asynchronous' if asynchronous else 'synchronous'} ({_origins(given, gpu)})")


def _evaluation(cfg: Config, gpu: bool) -> tuple[int, float, str]:
    every = cfg.eval_every if cfg.eval_every is not None else (0 if gpu else 1)
    minutes = cfg.eval_every_minutes if cfg.eval_every_minutes is not None else (GPU_EVAL_EVERY_MINUTES if gpu else 0.0)
    parts = [f"every {every} epochs" if every else "", f"at an epoch's end {minutes:g} min after the last" if minutes
             else ""]
    when = " and ".join(p for p in parts if p)
    given = {"epochs": cfg.eval_every is not None, "minutes": cfg.eval_every_minutes is not None}
    return every, minutes * 60, (f"evaluation {when + ', and' if when else 'only'} after the last epoch "
                                 f"({_origins(given, gpu)})")


def _origins(given: dict[str, bool], gpu: bool) -> str:
    auto = [name for name, was_given in given.items() if not was_given]
    if not auto:
        return "given"
    where = "auto on GPU" if gpu else "auto on CPU"
    return where if len(auto) == len(given) else f"{', '.join(auto)} {where}"
