"""Entry point: ``python -m trainer`` (one process) or ``torchrun ... -m trainer`` (N processes). Wiring only."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from . import checkpoint, data, dist, loop, models, state
from .config import Config, parse
from .dist import DistContext
from .errors import ConfigError, TrainerError
from .metrics import setup_logging

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
    train, test = _agreed(ctx, lambda: data.load_cifar(cfg.data_dir, cfg.allow_unverified_data))
    if cfg.batch_size * ctx.world_size > len(train):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} x {ctx.world_size} processes = {cfg.batch_size * ctx.world_size} "
            f"exceeds the {len(train)} training images; lower --batch-size"
        )
    return train.to(ctx.device), test.to(ctx.device)


def _train(cfg: Config, ctx: DistContext) -> int:
    train, test = _prepare_data(cfg, ctx)
    _agreed(ctx, lambda: checkpoint.check_writable(cfg.ckpt_dir) if ctx.is_main else None)
    st = state.build(cfg, ctx)
    if cfg.resume:
        _agreed(ctx, lambda: state.restore(cfg, ctx, st))
    state.wrap(cfg, ctx, st)
    loader = data.TrainLoader(train, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed)
    log.info("model %s (%.2fM params) precision %s device %s backend %s world_size %d batch %d/process "
             "global batch %d, %d train / %d test images, %d steps/epoch",
             cfg.model, sum(p.numel() for p in st.model.parameters()) / 1e6, cfg.precision, ctx.device,
             ctx.backend if ctx.distributed else "none", ctx.world_size, cfg.batch_size, loader.global_batch,
             len(train), len(test), loader.steps())
    stop = loop.StopRequest()
    stop.install()
    return loop.run(cfg, ctx, st, loader, test, stop)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, legacy_local_rank = parse(argv)
        ctx = dist.context_from_env(cfg.device, legacy_local_rank)
        setup_logging(ctx.rank, ctx.is_main)
        state.check_device(cfg, ctx)
        models.check_name(cfg.model)
    except TrainerError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        dist.init(ctx, cfg.dist_timeout)
        return _train(cfg, ctx)
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


if __name__ == "__main__":
    raise SystemExit(main())
