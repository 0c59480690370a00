"""The training loop: learning-rate schedule, one mixed-precision step, sharded evaluation, stop handling."""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from . import checkpoint, dist, metrics
from .config import Config
from .data import Split, TrainLoader, normalize
from .dist import DistContext
from .errors import CheckpointError
from .precision import autocast
from .state import TrainState, memory_format, to_checkpoint

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_SIGTERM = 143


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


def train_step(st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str) -> torch.Tensor:
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    x = _model_layout(x)
    with autocast(x.device, precision):
        loss = F.cross_entropy(st.ddp(x), y)
    st.optimizer.zero_grad(set_to_none=True)
    st.scaler.scale(loss).backward()  # the scaler is a pass-through unless fp16
    st.scaler.step(st.optimizer)
    st.scaler.update()
    return loss.detach()


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


class StopRequest:
    """SIGTERM sets a flag; the loop finishes its step, agrees with the other ranks, saves and exits 143."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # only a flag: no I/O or locks inside a signal handler


@dataclass
class EpochStats:
    loss: float
    images_per_s: float
    complete: bool


def save(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader) -> Path | None:
    """Global rank 0 writes; every rank learns whether it worked (a collective, so no rank is left waiting)."""
    path, err = None, None
    if ctx.is_main:
        try:
            path = checkpoint.save(
                cfg.ckpt_dir, to_checkpoint(cfg, ctx, st, loader.global_batch), step=st.pos.step,
                epoch=st.pos.epoch, epoch_complete=st.pos.sample == 0, world_size=ctx.world_size,
                keep=cfg.keep_checkpoints)
            log.info("checkpoint %s", path)
        except CheckpointError as e:
            err = e
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("global rank 0 could not write the checkpoint; see its error line")
    return path


def _train_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stop: StopRequest) -> EpochStats:
    n = len(loader.split)
    total = torch.zeros(2, dtype=torch.float64, device=loader.split.images.device)
    steps_done, t0 = 0, time.perf_counter()
    for x, y in loader.batches(st.pos.epoch, st.pos.sample):
        lr = lr_at(cfg, st.pos.epoch + (st.pos.sample + loader.global_batch) / n)
        loss = train_step(st, x, y, lr, cfg.precision)
        total[0] += loss.double() * len(y)
        total[1] += len(y)
        st.pos.step += 1
        st.pos.sample += loader.global_batch
        steps_done += 1
        if st.pos.step % cfg.log_every == 0:
            log.info("epoch %d step %d loss %.4f lr %.5f", st.pos.epoch + 1, st.pos.step, loss.item(), lr)
        hit_max = cfg.max_steps > 0 and st.pos.step >= cfg.max_steps
        # Every rank must stop at the same step, though the signal reaches them at different times.
        stop.requested = dist.any_rank(ctx, stop.requested)
        if stop.requested or hit_max:
            break
    elapsed = time.perf_counter() - t0
    total = dist.sum_tensor(ctx, total)
    complete = loader.steps(st.pos.sample) == 0
    if complete:
        st.pos.epoch, st.pos.sample = st.pos.epoch + 1, 0
    loss_mean = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return EpochStats(loss_mean, steps_done * loader.global_batch / max(elapsed, 1e-9), complete)


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
                 stats: EpochStats) -> float | None:
    """Evaluate, log, append metrics and checkpoint when due; returns the test accuracy if evaluated."""
    last = st.pos.epoch >= cfg.epochs
    acc = None
    if last or st.pos.epoch % cfg.eval_every == 0:
        acc = evaluate(st.model, test, ctx, cfg.precision, cfg.eval_batch_size)
    _record_epoch(cfg, ctx, st, loader, stats, acc)
    if not last and st.pos.epoch % cfg.ckpt_every == 0:
        save(cfg, ctx, st, loader)
    return acc


def _stop(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stats: EpochStats) -> int:
    """SIGTERM: the checkpoint first (SIGKILL follows within torchrun's 30 s, docker stop's 10 s). An epoch the
    stop happened to complete still gets its metrics line, with test_acc null: there is no time to evaluate,
    and the resumed run starts the next epoch (the position, not this line, is what resume relies on)."""
    path = save(cfg, ctx, st, loader)
    _record_epoch(cfg, ctx, st, loader, stats, acc=None, partial=not stats.complete)
    log.warning("stopped by SIGTERM at step %d (epoch %d, sample %d); checkpoint %s",
                st.pos.step, st.pos.epoch + 1, st.pos.sample, path)
    dist.barrier(ctx)
    return EXIT_SIGTERM


def run(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, test: Split, stop: StopRequest) -> int:
    """Train from st.pos to the last epoch (or --max-steps, or SIGTERM); returns the exit code."""
    acc: float | None = None
    stats: EpochStats | None = None
    while st.pos.epoch < cfg.epochs:
        if cfg.max_steps and st.pos.step >= cfg.max_steps:
            break
        stats = _train_epoch(cfg, ctx, st, loader, stop)
        if stop.requested:
            return _stop(cfg, ctx, st, loader, stats)
        if stats.complete:
            acc = _after_epoch(cfg, ctx, st, loader, test, stats)
    if acc is None or st.pos.sample != 0:
        acc = evaluate(st.model, test, ctx, cfg.precision, cfg.eval_batch_size)
        if stats is not None and not stats.complete:  # --max-steps inside an epoch: its record, marked partial
            _record_epoch(cfg, ctx, st, loader, stats, acc, partial=True)
    path = save(cfg, ctx, st, loader)
    # Every rank is past its last collective before any tears the process group down (gloo aborts a
    # rank whose peer closes the connection under it).
    dist.barrier(ctx)
    log.info("DONE epochs=%d step=%d test_acc=%.4f checkpoint=%s", st.pos.epoch, st.pos.step, acc, path)
    return EXIT_OK
