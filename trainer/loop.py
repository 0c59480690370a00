"""The training loop: learning-rate schedule, one mixed-precision step, sharded evaluation, the epoch's steps and
what follows them (evaluation, records, the checkpoints pace.py's clocks and saving.py write), the stop."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from . import dist, metrics, parallel
from .config import Config
from .contract import EXIT_STOPPED, STOP_LINE
from .data import Split, TrainLoader, normalize
from .defaults import RunSettings
from .device import memory_format
from .dist import DistContext
from .pace import AGREE_EVERY, LoopState, StopRequest
from .precision import autocast
from .saving import diverged_error, save
from .state import TrainState

log = logging.getLogger(__name__)

EXIT_OK = 0


def lr_at(run: RunSettings, progress: float) -> float:
    """Linear warmup to the (scaled) peak, then cosine to 0, as a function of epochs done (fractional).

    A pure function of the position in the data, so a resume with the same global batch continues with exactly
    the learning rate the uninterrupted run would have used (another global batch scales it by defaults.scaled_lr).
    """
    if run.warmup_epochs > 0 and progress < run.warmup_epochs:
        return run.lr * progress / run.warmup_epochs
    span = run.epochs - run.warmup_epochs
    if span <= 0:
        return run.lr
    t = min(1.0, (progress - run.warmup_epochs) / span)
    return run.lr * 0.5 * (1.0 + math.cos(math.pi * t))


def _model_layout(x: torch.Tensor) -> torch.Tensor:
    """Inputs in the model's memory format (channels_last on CUDA; a no-op for a contiguous CPU batch)."""
    return x.contiguous(memory_format=memory_format(x.device))


def train_step(st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str,
               micro: int = 0, forward: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
               ) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch, in micro-batches of at most `micro` images
    (0: all at once) whose gradients add up to the full share's: gradient accumulation, the gradients reduced over
    the processes only after the last one (_gradient_sync). `forward` is entered around each forward (the rank's timer). Returns the share's mean loss."""
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    x = _model_layout(x)
    st.optimizer.zero_grad(set_to_none=True)
    parts = list(zip(x.split(micro), y.split(micro), strict=True)) if 0 < micro < len(y) else [(x, y)]
    total = torch.zeros((), device=x.device)
    for i, (xs, ys) in enumerate(parts):
        with _gradient_sync(st.ddp, last=i == len(parts) - 1, accumulating=len(parts) > 1):
            with autocast(x.device, precision):
                with forward():
                    out = st.ddp(xs)
                loss = F.cross_entropy(out, ys) * (len(ys) / len(y))
            st.scaler.scale(loss).backward()  # the scaler is a pass-through unless fp16
        total += loss.detach()
    st.scaler.step(st.optimizer)
    st.scaler.update()
    return total


def evaluate(model: nn.Module, test: Split, ctx: DistContext, precision: str, batch: int) -> float:
    """Test accuracy without augmentation (see evaluate_counts)."""
    correct, total = evaluate_counts(model, test, ctx, precision, batch)
    return correct / total if total > 0 else 0.0


def _gradient_sync(module: nn.Module, last: bool, accumulating: bool) -> AbstractContextManager[None]:
    """Gradients reduced over the processes only in the last micro-batch's backward: DDP's no_sync before it;
    FSDP2's switch (set_requires_gradient_sync: no reduce-scatter, and under HSDP no cross-node all-reduce, until
    the last; the unsharded gradients accumulate meanwhile, a full gradient's memory per unit). A plain module
    has nothing to reduce."""
    if parallel.is_fully_sharded(module):
        if accumulating:
            module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    no_sync = getattr(module, "no_sync", None)
    return no_sync() if not last and callable(no_sync) else contextlib.nullcontext()


@torch.no_grad()
def evaluate_counts(model: nn.Module, test: Split, ctx: DistContext, precision: str, batch: int
                    ) -> tuple[int, int]:
    """(correct, evaluated) over the whole test split, the same on every rank; rank r takes samples r, r+W, ...
    (disjoint, no padding, none counted twice) and both counts are summed over all ranks."""
    if ctx.distributed:
        for buf in model.buffers():  # BatchNorm running stats drift per rank after the last step: use rank 0's
            tdist.broadcast(buf, src=0)
    was_training = model.training
    model.eval()
    idx = torch.arange(ctx.rank, len(test), ctx.world_size, device=test.images.device)
    counts = torch.zeros(2, dtype=torch.float64, device=test.images.device)
    for part in _eval_batches(idx, batch, len(test), ctx.world_size, lockstep=parallel.is_fully_sharded(model)):
        rows = part if len(part) else part.new_zeros(1)  # an empty lockstep batch: image 0, not counted
        x = _model_layout(normalize(test.images[rows]))
        with autocast(x.device, precision):
            pred = model(x).argmax(dim=1)
        if len(part):
            counts[0] += (pred == test.labels[part]).sum()
            counts[1] += len(part)
    model.train(was_training)
    counts = dist.sum_tensor(ctx, counts)
    return int(counts[0]), int(counts[1])


def _eval_batches(idx: torch.Tensor, batch: int, n_test: int, world: int, lockstep: bool) -> list[torch.Tensor]:
    """This rank's evaluation batches. `lockstep` (a sharded model): as many batches on every rank as the rank
    with the most samples has, the missing ones empty. Each forward of an FSDP model all-gathers parameters with
    every other rank, so a rank that ran one batch fewer (10000 test images on 3 ranks: 3334, 3333, 3333) would
    leave its peers waiting in an all-gather until the collective timeout. An empty batch runs one image's
    forward, whose prediction is not counted."""
    parts = list(idx.split(batch))
    if lockstep:
        most = math.ceil(math.ceil(n_test / world) / batch)
        parts += [idx[:0]] * (most - len(parts))
    return parts


@dataclass
class EpochStats:
    loss: float
    images_per_s: float
    complete: bool
    stopped: bool = False  # every rank agreed to stop (SIGTERM on any of them)
    # Rank 0's clocks as every rank agreed at the epoch's last step: the epoch-end save and evaluation follow
    # these, never rank 0's clock read again (rank 0 alone would enter their collectives).
    save_due: bool = False
    eval_due: bool = False


def _train_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stop: StopRequest,
                 pace: LoopState) -> EpochStats:
    n = len(loader.split)
    total = torch.zeros(2, dtype=torch.float64, device=loader.split.images.device)
    steps_done, stopped, save_due, eval_due, t0 = 0, False, False, False, time.perf_counter()
    run = pace.settings
    pace.restart_clocks(st.pos.step)
    batches = loader.batches(st.pos.epoch, st.pos.sample)
    for x, y in pace.timer.batches(batches) if pace.timer else batches:
        lr = lr_at(run, st.pos.epoch + (st.pos.sample + loader.global_batch) / n)
        loss = pace.strategy.train_step(st, x, y, lr, run.precision, pace.micro,
                                        pace.timer.forward if pace.timer else contextlib.nullcontext)
        total[0] += loss.double() * len(y)
        total[1] += len(y)
        st.pos.step += 1
        st.pos.sample += loader.global_batch
        steps_done += 1
        # The loss read is a host sync: rank 0's alone, for its step record; the heartbeat shows the newest one.
        read = loss.item() if pace.steps and st.pos.step % cfg.log_every == 0 else None
        pace.heartbeat.step_done(st.pos.step, st.pos.epoch + 1, read)
        if pace.steps and read is not None:
            pace.steps.record(st.pos.step, st.pos.epoch + 1, read, lr, pace.heartbeat.rank_fields)
        hit_max = cfg.max_steps > 0 and st.pos.step >= cfg.max_steps
        epoch_end = loader.steps(st.pos.sample) == 0
        if not (hit_max or epoch_end or pace.cadence.due(st.pos.step)):
            continue
        # Every rank must stop (or save, or evaluate) at the same step, though a signal or rank 0's clocks tell
        # them at different times: one all_reduce of the flags, at the cadence's steps and wherever the loop may
        # end.
        # The agreed value, never the flag itself: a signal landing after this line sets the flag on one rank
        # only, and a rank that acted on it alone would meet its peers in another collective (gloo aborts).
        # The flag stays set, so the next agreement stops every rank.
        # The loss rides in the same all_reduce: a non-finite one on any rank (fp16's skipped steps have inf
        # gradients, not an inf loss) stops every rank here, before any save.
        # Each rank's step timings ride in it too (ranktime.py), and its seconds per step (the cadence's): no
        # collective of their own.
        agreed = dist.agree(ctx, total[0], stop.requested, pace.save_due(ctx), pace.eval_due(ctx),
                            step_s=pace.cadence.step_s, times=pace.timer.send() if pace.timer else ())
        (stopped, save_due, eval_due), diverged = agreed.flags, agreed.diverged
        pace.cadence.agreed(st.pos.step, agreed.slowest_step_s)
        # The rank timings' window stays AGREE_EVERY steps (or the epoch's rest): the straggler rule's streak
        # counts windows, and a one-step window of a slow job would let one preempted step count.
        if pace.timer and (hit_max or epoch_end or st.pos.step % AGREE_EVERY == 0):
            pace.heartbeat.ranks(pace.timer.window_done(agreed.times), ctx.local_world_size,
                                 pace.strategy.rank_stages(ctx))
        if diverged:
            raise diverged_error(run.precision, st.pos.step, f"loss {float(loss):g}", lr)
        if stopped or hit_max:
            break
        if save_due and not epoch_end:  # at an epoch's end, _after_epoch's save is due anyway
            save(cfg, ctx, st, loader, pace, background=run.ckpt_async)
            pace.restart_clocks(st.pos.step)
    elapsed = time.perf_counter() - t0
    total = dist.sum_tensor(ctx, total)
    complete = loader.steps(st.pos.sample) == 0
    if complete:
        st.pos.epoch, st.pos.sample = st.pos.epoch + 1, 0
    loss_mean = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return EpochStats(loss_mean, steps_done * loader.global_batch / max(elapsed, 1e-9), complete, stopped,
                      save_due, eval_due)


def _record_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stats: EpochStats,
                  pace: LoopState, acc: float | None, partial: bool = False) -> None:
    """The epoch's log line and metrics.jsonl record (global rank 0; no collective). `partial`: the run ended
    inside the epoch (--max-steps, SIGTERM); `epoch` then counts the complete epochs before it."""
    if not ctx.is_main:
        return
    lr = lr_at(pace.settings, float(st.pos.epoch))
    acc_txt = f"{acc:.4f}" if acc is not None else "-"
    log.info("epoch %d/%d step %d train_loss %.4f test_acc %s images/s %.0f lr %.5f",
             st.pos.epoch, cfg.epochs, st.pos.step, stats.loss, acc_txt, stats.images_per_s, lr)
    metrics.append_metrics(cfg.ckpt_dir, {
        "epoch": st.pos.epoch, "step": st.pos.step, "train_loss": stats.loss, "test_acc": acc,
        "images_per_s": stats.images_per_s, "lr": lr, "world_size": ctx.world_size,
        "global_batch": loader.global_batch, **({"partial": True} if partial else {})})


def _after_epoch(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, test: Split,
                 stats: EpochStats, pace: LoopState) -> float | None:
    """Evaluate, log, append metrics and checkpoint when due (by epoch or by rank 0's agreed clock); returns the
    test accuracy if evaluated. The last epoch is always evaluated; its checkpoint is the run's final save."""
    run = pace.settings
    last = st.pos.epoch >= cfg.epochs
    acc = None
    if last or _every(st.pos.epoch, run.eval_every) or stats.eval_due:
        acc = _evaluate(cfg, ctx, st, test, pace)
    _record_epoch(cfg, ctx, st, loader, stats, pace, acc)
    if not last and (_every(st.pos.epoch, run.ckpt_every) or stats.save_due):
        save(cfg, ctx, st, loader, pace, background=run.ckpt_async)
    return acc


def _every(epoch: int, every: int) -> bool:
    """`every` 0: not by epoch."""
    return every > 0 and epoch % every == 0


def _evaluate(cfg: Config, ctx: DistContext, st: TrainState, test: Split, pace: LoopState) -> float:
    pace.heartbeat.mark("evaluating", step=st.pos.step)
    acc = pace.strategy.evaluate(st, test, ctx, pace.settings.precision, cfg.eval_batch_size)
    pace.last_eval = time.monotonic()
    return acc


def _stop(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, stats: EpochStats, pace: LoopState) -> int:
    """SIGTERM: the checkpoint first (SIGKILL follows within torchrun's 30 s, docker stop's 10 s). An epoch the
    stop happened to complete still gets its metrics line, with test_acc null: there is no time to evaluate,
    and the resumed run starts the next epoch (the position, not this line, is what resume relies on)."""
    path = save(cfg, ctx, st, loader, pace)  # after the pending background write: a complete checkpoint
    _record_epoch(cfg, ctx, st, loader, stats, pace, acc=None, partial=not stats.complete)
    pace.heartbeat.mark("stopped")
    log.warning("%s at step %d (epoch %d, sample %d); checkpoint %s", STOP_LINE,
                st.pos.step, st.pos.epoch + 1, st.pos.sample, path)
    dist.barrier(ctx)
    return EXIT_STOPPED


def run(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, test: Split, stop: StopRequest,
        pace: LoopState) -> int:
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
        acc = _evaluate(cfg, ctx, st, test, pace)
        if stats is not None and not stats.complete:  # --max-steps inside an epoch: its record, marked partial
            _record_epoch(cfg, ctx, st, loader, stats, pace, acc, partial=True)
    path = save(cfg, ctx, st, loader, pace)  # synchronous, after the pending background write
    pace.heartbeat.mark("done", step=st.pos.step, epoch=st.pos.epoch, eta_s=0)
    # Every rank is past its last collective before any tears the process group down (gloo aborts a
    # rank whose peer closes the connection under it).
    dist.barrier(ctx)
    log.info("DONE epochs=%d step=%d test_acc=%.4f checkpoint=%s", st.pos.epoch, st.pos.step, acc, path)
    return EXIT_OK
