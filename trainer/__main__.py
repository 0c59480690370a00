"""Entry point: ``python -m trainer`` (one process) or ``torchrun ... -m trainer`` (N processes). Wiring only."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn, TypeVar

from . import (
    checkpoint,
    data,
    defaults,
    device,
    dist,
    hardware,
    loop,
    models,
    parallel,
    precision,
    state,
    strategies,
)
from .config import Config, parse
from .contract import ENV_LOG_DIR, EXIT_DIVERGED, stack_file_name
from .dist import DistContext
from .errors import ConfigError, DivergedError, TrainerError
from .metrics import Heartbeat, StepLog, is_restart, open_tensorboard, record_resume, setup_logging
from .pace import LoopState, StopRequest
from .ranktime import RankTimer, enabled_by_env

log = logging.getLogger("trainer")
T = TypeVar("T")


def _agreed(ctx: DistContext, fn: Callable[[], T]) -> T:
    """Run a setup step on every rank; if it fails on any rank, every rank stops (none waits forever)."""
    err: TrainerError | None = None
    result = None
    try:
        result = fn()
    except TrainerError as e:
        err = e
    if dist.any_rank(ctx, err is not None):
        raise err or TrainerError("another rank failed during setup; see its error line")
    return result  # type: ignore[return-value]


def _prepare_data(cfg: Config, ctx: DistContext) -> tuple[data.Split, data.Split]:
    if ctx.local_rank == 0:  # one extraction per node
        _agreed(ctx, lambda: data.extract_archive(cfg.data_dir, cfg.allow_unverified_data))
    else:
        _agreed(ctx, lambda: None)
    train, test = _agreed(ctx, lambda: data.load_cifar(cfg.data_dir, cfg.allow_unverified_data, warn=ctx.is_main))
    if cfg.batch_size * ctx.world_size > len(train):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} x {ctx.world_size} processes = {cfg.batch_size * ctx.world_size} "
            f"exceeds the {len(train)} training images; lower --batch-size"
        )
    return train.to(ctx.device), test.to(ctx.device)


def _train(cfg: Config, ctx: DistContext) -> int:
    train, test = _prepare_data(cfg, ctx)
    _agreed(ctx, lambda: checkpoint.check_writable(cfg.ckpt_dir) if ctx.is_main else None)
    # The run's first line once its inputs are known good (a run refused before prints its error line alone).
    settings = _settings(cfg, ctx, cfg.batch_size * ctx.world_size)
    strategy = strategies.for_config(cfg)
    st = strategy.build(cfg, ctx)
    saved_batch = _agreed(ctx, lambda: strategy.restore(cfg, ctx, st)) if cfg.resume else 0
    strategy.wrap(cfg, ctx, st)
    per_rank, micro = _batch_split(cfg, ctx, saved_batch)
    strategy.check_batch(ctx, per_rank)
    share, shares = strategy.data_share(ctx)  # the stages of one pipeline read the same images
    loader = data.TrainLoader(train, per_rank * ctx.world_size // shares, share, shares, cfg.seed)
    if (cfg.resume or is_restart()) and ctx.is_main:
        record_resume(cfg.ckpt_dir, st.pos.step, st.pos.epoch, ctx.world_size, loader.global_batch)
    if loader.global_batch != settings.global_batch:  # --keep-global-batch: the lr of the checkpoint's batch
        settings = _settings(cfg, ctx, loader.global_batch)
    log.info("%s: %s (grads and optimizer as of the first step)", cfg.strategy,
             parallel.expected_memory(st.model, st.optimizer).describe())
    log.info("model %s (%.2fM params) precision %s device %s backend %s world_size %d batch %d/process "
             "global batch %d, %d train / %d test images, %d steps/epoch",
             cfg.model, sum(p.numel() for p in st.model.parameters()) / 1e6, settings.precision, ctx.device,
             ctx.backend if ctx.distributed else "none", ctx.world_size, cfg.batch_size, loader.global_batch,
             len(train), len(test), loader.steps())
    stop = StopRequest()
    stop.install()
    speed = hardware.measure(cfg.model, ctx.device, settings.precision, ctx.world_size) if ctx.is_main else None
    beat = Heartbeat(cfg.ckpt_dir, ctx.is_main, _total_steps(cfg, st.pos, loader), cfg.epochs, loader.global_batch,
                     speed)
    group = dist.checkpoint_group(ctx, cfg.dist_timeout) if settings.ckpt_async and strategy.sharded_checkpoints else None
    steps = StepLog(cfg.ckpt_dir, loader.global_batch, speed, open_tensorboard(
        cfg.ckpt_dir, st.pos.step if cfg.resume or is_restart() else None)) if ctx.is_main else None
    timer = RankTimer(ctx.device, ctx.world_size) if enabled_by_env() else None
    pace = LoopState(beat, settings, strategy, micro=micro, ckpt_group=group, timer=timer, steps=steps)
    try:
        return loop.run(cfg, ctx, st, loader, test, stop, pace)
    finally:
        if steps:
            steps.close()


def _settings(cfg: Config, ctx: DistContext, global_batch: int) -> defaults.RunSettings:
    """What "auto" becomes on this device, logged by global rank 0: its first line says what and why."""
    settings = defaults.resolve(cfg, ctx.device.type, precision.bf16_fast(ctx.device), global_batch)
    log.info("%s", settings.describe())
    return settings


def _batch_split(cfg: Config, ctx: DistContext, saved_batch: int) -> tuple[int, int]:
    """(images per rank and step, micro-batch size or 0). --keep-global-batch on a resume with another world
    size keeps the checkpoint's global batch: each rank takes global/world images per step, in micro-batches of
    at most --batch-size (gradient accumulation), so the schedule and the data order are the run's own."""
    if not (cfg.keep_global_batch and saved_batch) or saved_batch == cfg.batch_size * ctx.world_size:
        return cfg.batch_size, 0
    if saved_batch % ctx.world_size:
        raise ConfigError(f"--keep-global-batch: the checkpoint's global batch {saved_batch} does not split evenly "
                          f"over {ctx.world_size} processes; resume with a process count that divides it")
    per_rank = saved_batch // ctx.world_size
    micro = cfg.batch_size if per_rank > cfg.batch_size else 0
    log.info("global batch %d kept with %d processes: %d images per process and step%s", saved_batch,
             ctx.world_size, per_rank, f", in micro-batches of {micro} (gradient accumulation)" if micro else "")
    return per_rank, micro


def _total_steps(cfg: Config, pos: state.Position, loader: data.TrainLoader) -> int:
    total = pos.step + loader.steps(pos.sample) + max(0, cfg.epochs - pos.epoch - 1) * loader.steps()
    return min(total, cfg.max_steps) if cfg.max_steps else total


_stack_file: IO[str] | None = None  # kept open for faulthandler, which writes from its signal handler


def _stack_dumps_on_sigusr1(rank: int) -> None:
    """SIGUSR1 makes this rank write every thread's Python stack (docs/DESIGN.md §7): the orchestrator asks
    for them when the job stalls. faulthandler writes from the signal handler itself, so a rank blocked in a
    collective's C++ wait still answers; a rank that does not is frozen below Python (or stopped)."""
    global _stack_file
    folder = os.environ.get(ENV_LOG_DIR)
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        _stack_file = open(Path(folder) / stack_file_name(rank), "w") if folder else sys.stderr  # noqa: SIM115
    except OSError:
        _stack_file = sys.stderr
    try:
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    except (OSError, ValueError):  # a stderr without a file descriptor (embedded, captured): no dumps
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, legacy_local_rank = parse(argv)
        ctx = dist.context_from_env(cfg.device, legacy_local_rank)
        setup_logging(ctx.rank, ctx.is_main)
        _stack_dumps_on_sigusr1(ctx.rank)
        device.check_device(cfg, ctx)
        models.check_name(cfg.model)
    except TrainerError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        dist.init(ctx, cfg.dist_timeout)
        code = _train(cfg, ctx)
        if code == 0:
            # No rank tears its group down while a peer still works (rank 0's last checkpoint): with gloo that
            # aborted the early rank now and then ("terminate called without an active exception", 3 of 12 runs).
            dist.barrier(ctx)
        return code
    except DivergedError as e:
        if ctx.local_rank == 0:  # every rank stops at the same step: one line per node says why
            sys.stderr.write(f"error: {e}\n")
        return EXIT_DIVERGED
    except TrainerError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except RuntimeError as e:
        if not dist.is_communication_failure(e):
            raise  # a bug: keep the traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"error: lost contact with another rank (it died, hangs or the network dropped), "
                         f"after --dist-timeout {cfg.dist_timeout:g}s at most: {first}; "
                         f"restart the job with --resume\n")
        return 1
    finally:
        dist.shutdown()  # always, whatever happened: no lingering process group


def exit_without_finalizing(code: int) -> NoReturn:
    """Flush what this process printed, then end it without the interpreter's finalization.

    Why: torch's C++ threads (gloo's transport loop and workers; 3 per process here) outlive
    destroy_process_group and even a gc. One that takes the GIL while the interpreter finalizes is ended by
    pthread_exit through a noexcept frame, and the rank dies with SIGABRT ("terminate called without an
    active exception") after a successful run, so its node counts as failed. Seen in several full test runs
    (our trainer, the examples), never on demand; the cause is inferred from pytorch/pytorch#38230, #179291.
    Nothing of ours needs finalization: checkpoints and metrics are closed files, and logs are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, _stack_file):
        if stream is not None and not stream.closed:
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main())
