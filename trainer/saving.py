"""When and how a checkpoint is written from the loop: now or in the background, full (DDP, global rank 0) or sharded
(every rank), after the pending one, never of non-finite weights; every rank learns how it went (trainer/loop.py
calls it; checkpoint.py, dcp_checkpoint.py and snapshot.py hold the formats)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from . import checkpoint, dist, parallel
from .config import Config
from .contract import DIVERGED_LINE
from .data import TrainLoader
from .dcp_checkpoint import finish_save
from .dist import DistContext
from .errors import CheckpointError, DivergedError
from .pace import LoopState
from .snapshot import off_device, save_sharded, start_sharded, to_checkpoint
from .state import Position, TrainState

log = logging.getLogger(__name__)


def save(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, pace: LoopState,
         background: bool = False) -> Path | None:
    """A checkpoint of this step, after the pending one (at most one in flight). `background` (DDP): global
    rank 0 copies the state to the CPU and writes it in a thread while training goes on; returns None, and
    the next save (or the end) learns how it went. Otherwise global rank 0 writes now and every rank learns
    whether it worked (a collective, so no rank is left waiting); FSDP's ranks each write their shards."""
    finish_pending_save(cfg, ctx, pace, fail=background)
    refuse_nonfinite_weights(ctx, st, pace.settings.precision)
    pace.heartbeat.mark("checkpointing", step=st.pos.step)
    path = None
    if pace.strategy.sharded_checkpoints and background:
        pace.shards = start_sharded(cfg, ctx, st, loader.global_batch, pace.ckpt_group)
    elif pace.strategy.sharded_checkpoints:  # every rank writes its own shards; a failure raises on every rank alike
        path = save_sharded(cfg, ctx, st, loader.global_batch)
    elif background and ctx.is_main:
        _save_in_background(cfg, ctx, st, loader, pace)
    elif not background:
        path = _save_now(cfg, ctx, st, loader)
    pace.last_save = time.monotonic()
    pace.heartbeat.mark("training", step=st.pos.step, **({"ckpt_step": st.pos.step} if path else {}))
    return path


def _write_full(cfg: Config, ctx: DistContext, state: dict[str, object], pos: Position) -> Path:
    return checkpoint.save(cfg.ckpt_dir, state, step=pos.step, epoch=pos.epoch, epoch_complete=pos.sample == 0,
                           world_size=ctx.world_size, keep=cfg.keep_checkpoints)


def _save_now(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader) -> Path | None:
    path, err = None, None
    if ctx.is_main:
        t0 = time.monotonic()
        try:
            path = _write_full(cfg, ctx, to_checkpoint(cfg, ctx, st, loader.global_batch), st.pos)
            log.info("checkpoint %s (training paused %.2f s)", path, time.monotonic() - t0)
        except CheckpointError as e:
            err = e
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("global rank 0 could not write the checkpoint; see its error line")
    return path


def _save_in_background(cfg: Config, ctx: DistContext, st: TrainState, loader: TrainLoader, pace: LoopState) -> None:
    """Global rank 0: the pause is the copy of the state to the CPU; the write, fsync and sha256 run in the
    writer's thread."""
    t0 = time.monotonic()
    state = off_device(to_checkpoint(cfg, ctx, st, loader.global_batch))
    pos = Position(st.pos.epoch, st.pos.sample, st.pos.step)  # the step's own: training moves on
    pace.writer.start(lambda: _write_full(cfg, ctx, state, pos), pos.step)
    log.info("checkpoint of step %d copied off the device (training paused %.3f s), writing in the background",
             pos.step, time.monotonic() - t0)


def finish_pending_save(cfg: Config, ctx: DistContext, pace: LoopState, fail: bool = True) -> None:
    """Wait for the background write and tell every rank whether it worked. A collective on every rank when
    checkpoints are asynchronous (a setting every rank shares), nothing otherwise. A failed write raises on
    every rank, or with `fail` False (before the end's or a stop's own save, which must still be tried) is a
    warning."""
    if not pace.settings.ckpt_async:
        return
    try:
        if pace.strategy.sharded_checkpoints:
            _finish_sharded(cfg, ctx, pace)
        else:
            _finish_full(cfg, ctx, pace)
    except CheckpointError as e:
        if fail:
            raise
        if ctx.is_main:
            log.warning("%s; writing this step's checkpoint now", e)


def _finish_full(cfg: Config, ctx: DistContext, pace: LoopState) -> None:
    """DDP: global rank 0 waits for its writer thread; every rank learns the outcome (collective)."""
    err = None
    if ctx.is_main:
        try:
            step = pace.writer.wait(cfg.dist_timeout)
            if step is not None:
                pace.heartbeat.mark("training", ckpt_step=step)
        except CheckpointError as e:
            err = e
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("global rank 0 could not write the checkpoint; see its error line")


def _finish_sharded(cfg: Config, ctx: DistContext, pace: LoopState) -> None:
    """FSDP: every rank waits for its own background shard write, then rank 0 seals (collective)."""
    pending, pace.shards = pace.shards, None
    if pending is not None:
        finish_save(pending, ctx, cfg.dist_timeout)
        pace.heartbeat.mark("training", ckpt_step=pending.save.step)


def diverged_error(precision: str, step: int, what: str, lr: float) -> DivergedError:
    """`what`: `loss nan` (the agreement saw it) or `weights not finite` (a save refused them)."""
    hint = "lower --lr" + (" or use --precision bf16 (fp32's range, no loss scale)" if precision == "fp16" else
                           " (or lengthen --warmup-epochs)")
    return DivergedError(f"{DIVERGED_LINE} at step {step}: {what}, lr {lr:g}; no checkpoint of it was written, "
                         f"the newest one is from before; {hint}, then --resume")


def refuse_nonfinite_weights(ctx: DistContext, st: TrainState, precision: str) -> None:
    """No checkpoint of non-finite weights, ever: a step can leave them so with a loss that was still finite.
    Each rank checks what it holds (DDP: its full copy; FSDP: its shards, whose reduction over a replicated mesh
    dimension DTensor cannot do) and every rank learns the verdict, so all stop here together; once per save."""
    held = [parallel.local_part(p.detach()) for p in st.model.parameters()]
    bad = bool(held) and not bool(torch.stack([torch.isfinite(t).all() for t in held]).all())
    if dist.any_rank(ctx, bad):
        raise diverged_error(precision, st.pos.step, "weights not finite", st.optimizer.param_groups[0]["lr"])
