"""The training loop: learning-rate schedule, one mixed-precision step, sharded evaluation, stop handling."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from . import checkpoint, dist, metrics
from .config import Config
from .contract import DIVERGED_LINE, EXIT_STOPPED, STOP_LINE
from .data import Split, TrainLoader, normalize
from .device import memory_format
from .dist import DistContext
from .errors import CheckpointError, DivergedError
from .precision import autocast
from .snapshot import save_sharded, to_checkpoint
from .state import TrainState

log = logging.getLogger(__name__)

EXIT_OK = 0


def lr_at(cfg: Config, progress: float) -> float:
    """Linear warmup then cosine to 0, as a function of epochs done (fractional).

    A pure function of the position in the data, so a resume, even with another world size, continues
    with exactly the learning rate the uninterrupted run would have used.
    """
    if cfg.warmup_epochs > 0 and progress < cfg.warmup_epochs:
        return cfg.lr * progress / cfg.warmup_epochs
    span = cfg.epochs - cfg.warmup_epochs
    if span <= 0:
        return cfg.lr
    t = min(1.0, (progress - cfg.warmup_epochs) / span)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * t))


def _model_layout(x: torch.Tensor) -> torch.Tensor:
    """Inputs in the model's memory format (channels_last on CUDA; a no-op for a contiguous CPU batch)."""
    return x.contiguous(memory_format=memory_format(x.device))


def train_step(st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str,
               micro: int = 0) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch, in micro-batches of at most `micro` images
    (0: all at once) whose gradients add up to the full share's: gradient accumulation, DDP's all-reduce only on
    the last one. Returns the share's mean loss."""
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    x = _model_layout(x)
    st.optimizer.zero_grad(set_to_none=True)
    parts = list(zip(x.split(micro), y.split(micro), strict=True)) if 0 < micro < len(y) else [(x, y)]
    total = torch.zeros((), device=x.device)
    for i, (xs, ys) in enumerate(parts):
        last = i == len(parts) - 1
        # DDP.no_sync: no all_reduce for the micro-batches before the last (a plain module has none).
        skip_sync = st.ddp.no_sync() if not last and hasattr(st.ddp, "no_sync") else contextlib.nullcontext()  # type: ignore[operator]
        with skip_sync:
            with autocast(x.device, precision):
                loss = F.cross_entropy(st.ddp(xs), ys) * (len(ys) / len(y))
            st.scaler.scale(loss).backward()  # the scaler is a pass-through unless fp16
        total += loss.detach()
    st.scaler.step(st.optimizer)
    st.scaler.update()
    return total


@torch.no_grad()
def evaluate(model: nn.Module, test: Split, ctx: DistContext, precision: str, batch: int) -> float:
    """Test accuracy without augmentation; rank r takes samples r, r+W, ... (disjoint, no padding, none
    counted twice) and correct/total are summed over all ranks."""
    if ctx.distributed:
        for buf in model.buffers():  # BatchNorm running stats drift per rank after the last step: use rank 0's
            tdist.broadcast(buf, src=0)
    was_training = model.training
    model.eval()
    idx = torch.arange(ctx.rank, len(test), ctx.world_size, device=test.images.device)
    counts = torch.zeros(2, dtype=torch.float64, device=test.images.device)
    for lo in range(0, len(idx), batch):
        part = idx[lo : lo + batch]
        x = _model_layout(normalize(test.images[part]))
        with autocast(x.device, precision):
            pred = model(x).argmax(dim=1)
        counts[0] += (pred == test.labels[part]).sum()
        counts[1] += len(part)
    model.train(was_training)
    counts = dist.sum_tensor(ctx, counts)
    return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


# Steps between two agreements on the stop and save flags. The agreement is an all_reduce whose result the
# host reads: on a GPU that waits for every queued kernel, so doing it each step would drain the queue each
# step. Every 8 steps it costs 1/8 of that, and a SIGTERM waits at most 8 steps more (well under a second for
# a ResNet on a GPU; the grace before SIGKILL is 30 s).
AGREE_EVERY = 8


class StopRequest:
    """SIGTERM sets a flag; the loop finishes its step, agrees with the other ranks, saves and exits 143."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # only a flag: no I/O or locks inside a signal handler


# Test-only (tests/cluster/test_self_healing.py): global rank 0 raises at this global step, as a deterministic bug would.
CRASH_AT_STEP_ENV = "DDP_CIFAR_TEST_CRASH_AT_STEP"


@dataclass
class Pace:
    """What runs beside the steps: the heartbeat, the time-based checkpoint clock, the test-only crash."""

    heartbeat: metrics.Heartbeat
    ckpt_every_s: float = 0.0  # 0: no time-based checkpoints
    micro: int = 0  # micro-batch size for gradient accumulation (0: none)
    last_save: float = field(default_factory=lambda: time.monotonic())
    crash_at: int = field(default_factory=lambda: int(os.environ.get(CRASH_AT_STEP_ENV, "0") or 0))

    def save_due(self, ctx: DistContext) -> bool:
        """Rank 0's clock decides (the others agree through the step's flag all_reduce)."""
        return ctx.is_main and self.ckpt_every_s > 0 and time.monotonic() - self.last_save >= self.ckpt_every_s


@dataclass
class EpochStats:
    loss: float
    images_per_s: float
    complete: bool
    stopped: bool = False  # every rank agreed to stop (SIGTERM on any of them)
    # Rank 0's checkpoint clock as every rank agreed at the epoch's last step: the epoch-end save follows this,
    # never rank 0's clock read again (rank 0 alone would enter the save's collective).
    save_due: bool = False


def save(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, pace: Pace) -> Path | None:
    """Global rank 0 writes; every rank learns whether it worked (a collective, so no rank is left waiting)."""
    path, err = None, None
    _refuse_nonfinite_weights(cfg, st)
    pace.heartbeat.mark("checkpointing", step=st.pos.step)
    t0 = time.monotonic()
    if cfg.strategy == "fsdp":  # every rank writes its own shards; a failure raises on every rank alike
        path = save_sharded(cfg, ctx, st, loader.global_batch)
    elif ctx.is_main:
        try:
            path = checkpoint.save(
                cfg.ckpt_dir, to_checkpoint(cfg, ctx, st, loader.global_batch), step=st.pos.step,
                epoch=st.pos.epoch, epoch_complete=st.pos.sample == 0, world_size=ctx.world_size,
                keep=cfg.keep_checkpoints)
            log.info("checkpoint %s (training paused %.2f s)", path, time.monotonic() - t0)
        except CheckpointError as e:
            err = e
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("global rank 0 could not write the checkpoint; see its error line")
    pace.last_save = time.monotonic()
    pace.heartbeat.mark("training", step=st.pos.step, ckpt_step=st.pos.step)
    return path


def _diverged(cfg: Config, step: int, what: str, lr: float) -> DivergedError:
    """`what`: `loss nan` (the agreement saw it) or `weights not finite` (a save refused them)."""
    hint = "lower --lr" + (" or use --precision bf16 (fp32's range, no loss scale)" if cfg.precision == "fp16" else
                           " (or lengthen --warmup-epochs)")
    return DivergedError(f"{DIVERGED_LINE} at step {step}: {what}, lr {lr:g}; no checkpoint of it was written, "
                         f"the newest one is from before; {hint}, then --resume")


def _refuse_nonfinite_weights(cfg: Config, st: TrainState) -> None:
    """No checkpoint of non-finite weights, ever: a step can leave them so with a loss that was still finite.
    Every rank checks its own copy (DDP keeps them equal), so all stop here together; one read per save."""
    params = [p.detach() for p in st.model.parameters()]
    if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        raise _diverged(cfg, st.pos.step, "weights not finite", st.optimizer.param_groups[0]["lr"])


def _train_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stop: StopRequest,
                 pace: Pace) -> EpochStats:
    n = len(loader.split)
    total = torch.zeros(2, dtype=torch.float64, device=loader.split.images.device)
    steps_done, stopped, save_due, t0 = 0, False, False, time.perf_counter()
    for x, y in loader.batches(st.pos.epoch, st.pos.sample):
        lr = lr_at(cfg, st.pos.epoch + (st.pos.sample + loader.global_batch) / n)
        loss = train_step(st, x, y, lr, cfg.precision, pace.micro)
        total[0] += loss.double() * len(y)
        total[1] += len(y)
        st.pos.step += 1
        st.pos.sample += loader.global_batch
        steps_done += 1
        if ctx.is_main and st.pos.step == pace.crash_at:
            raise RuntimeError(f"injected crash at step {st.pos.step} ({CRASH_AT_STEP_ENV}, tests only)")
        pace.heartbeat.step_done(st.pos.step, st.pos.epoch + 1, loss.item)
        if st.pos.step % cfg.log_every == 0:
            log.info("epoch %d step %d loss %.4f lr %.5f", st.pos.epoch + 1, st.pos.step, loss.item(), lr)
        hit_max = cfg.max_steps > 0 and st.pos.step >= cfg.max_steps
        epoch_end = loader.steps(st.pos.sample) == 0
        if not (hit_max or epoch_end or st.pos.step % AGREE_EVERY == 0):
            continue
        # Every rank must stop (or save) at the same step, though a signal or rank 0's clock tells them at
        # different times: one all_reduce of both flags, every AGREE_EVERY steps and wherever the loop may end.
        # The agreed value, never the flag itself: a signal landing after this line sets the flag on one rank
        # only, and a rank that acted on it alone would meet its peers in another collective (gloo aborts).
        # The flag stays set, so the next agreement stops every rank.
        # The loss rides in the same all_reduce: a non-finite one on any rank (fp16's skipped steps have inf
        # gradients, not an inf loss) stops every rank here, before any save.
        (stopped, save_due), diverged = dist.agree(ctx, total[0], stop.requested, pace.save_due(ctx))
        if diverged:
            raise _diverged(cfg, st.pos.step, f"loss {float(loss):g}", lr)
        if stopped or hit_max:
            break
        if save_due and not epoch_end:  # at an epoch's end, _after_epoch's save is due anyway
            save(cfg, ctx, st, loader, pace)
    elapsed = time.perf_counter() - t0
    total = dist.sum_tensor(ctx, total)
    complete = loader.steps(st.pos.sample) == 0
    if complete:
        st.pos.epoch, st.pos.sample = st.pos.epoch + 1, 0
    loss_mean = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return EpochStats(loss_mean, steps_done * loader.global_batch / max(elapsed, 1e-9), complete, stopped,
                      save_due)


def _record_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stats: EpochStats,
                  acc: float | None, partial: bool = False) -> None:
    """The epoch's log line and metrics.jsonl record (global rank 0; no collective). `partial`: the run ended
    inside the epoch (--max-steps, SIGTERM); `epoch` then counts the complete epochs before it."""
    if not ctx.is_main:
        return
    lr = lr_at(cfg, float(st.pos.epoch))
    acc_txt = f"{acc:.4f}" if acc is not None else "-"
    log.info("epoch %d/%d step %d train_loss %.4f test_acc %s images/s %.0f lr %.5f",
             st.pos.epoch, cfg.epochs, st.pos.step, stats.loss, acc_txt, stats.images_per_s, lr)
    metrics.append_metrics(cfg.ckpt_dir, {
        "epoch": st.pos.epoch, "step": st.pos.step, "train_loss": stats.loss, "test_acc": acc,
        "images_per_s": stats.images_per_s, "lr": lr, "world_size": ctx.world_size,
        "global_batch": loader.global_batch, **({"partial": True} if partial else {})})


def _after_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, test: Split,
                 stats: EpochStats, pace: Pace) -> float | None:
    """Evaluate, log, append metrics and checkpoint when due; returns the test accuracy if evaluated."""
    last = st.pos.epoch >= cfg.epochs
    acc = None
    if last or st.pos.epoch % cfg.eval_every == 0:
        pace.heartbeat.mark("evaluating", step=st.pos.step)
        acc = evaluate(st.model, test, ctx, cfg.precision, cfg.eval_batch_size)
    _record_epoch(cfg, ctx, st, loader, stats, acc)
    if not last and (st.pos.epoch % cfg.ckpt_every == 0 or stats.save_due):
        save(cfg, ctx, st, loader, pace)
    return acc


def _stop(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stats: EpochStats, pace: Pace) -> int:
    """SIGTERM: the checkpoint first (SIGKILL follows within torchrun's 30 s, docker stop's 10 s). An epoch the
    stop happened to complete still gets its metrics line, with test_acc null: there is no time to evaluate,
    and the resumed run starts the next epoch (the position, not this line, is what resume relies on)."""
    path = save(cfg, ctx, st, loader, pace)
    _record_epoch(cfg, ctx, st, loader, stats, acc=None, partial=not stats.complete)
    pace.heartbeat.mark("stopped")
    log.warning("%s at step %d (epoch %d, sample %d); checkpoint %s", STOP_LINE,
                st.pos.step, st.pos.epoch + 1, st.pos.sample, path)
    dist.barrier(ctx)
    return EXIT_STOPPED


def run(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, test: Split, stop: StopRequest,
        pace: Pace) -> int:
    """Train from st.pos to the last epoch (or --max-steps, or SIGTERM); returns the exit code."""
    acc: float | None = None
    stats: EpochStats | None = None
    pace.heartbeat.mark("training", step=st.pos.step, epoch=st.pos.epoch + 1)
    while st.pos.epoch < cfg.epochs:
        if cfg.max_steps and st.pos.step >= cfg.max_steps:
            break
        stats = _train_epoch(cfg, ctx, st, loader, stop, pace)
        if stats.stopped:
            return _stop(cfg, ctx, st, loader, stats, pace)
        if stats.complete:
            acc = _after_epoch(cfg, ctx, st, loader, test, stats, pace)
    if acc is None or st.pos.sample != 0:
        pace.heartbeat.mark("evaluating")
        acc = evaluate(st.model, test, ctx, cfg.precision, cfg.eval_batch_size)
        if stats is not None and not stats.complete:  # --max-steps inside an epoch: its record, marked partial
            _record_epoch(cfg, ctx, st, loader, stats, acc, partial=True)
    path = save(cfg, ctx, st, loader, pace)
    pace.heartbeat.mark("done", step=st.pos.step, epoch=st.pos.epoch, eta_s=0)
    # Every rank is past its last collective before any tears the process group down (gloo aborts a
    # rank whose peer closes the connection under it).
    dist.barrier(ctx)
    log.info("DONE epochs=%d step=%d test_acc=%.4f checkpoint=%s", st.pos.epoch, st.pos.step, acc, path)
    return EXIT_OK
