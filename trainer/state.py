"""What training carries from step to step: model (plain, DDP-wrapped or FSDP-sharded), optimizer, scaler, position.

It is built here, saved into a checkpoint dict, and restored from one. Restoring a DDP checkpoint goes through
global rank 0: only rank 0 reads the checkpoint dir (other nodes may not have it), loads to the CPU and
broadcasts; every rank then copies into its own device's tensors, so nothing ever lands on another rank's GPU.
FSDP checkpoints are folders every rank reads its own shards from (dcp_checkpoint.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from . import checkpoint, dcp_checkpoint, models, parallel
from .config import Config, cuda_only
from .dist import DistContext
from .errors import CheckpointError, ConfigError, DeviceError

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where training stands: completed epochs, samples consumed in the current epoch, global steps."""

    epoch: int = 0
    sample: int = 0
    step: int = 0


@dataclass
class TrainState:
    model: nn.Module  # unwrapped (or FSDP-sharded): what checkpoints hold and evaluation runs
    ddp: nn.Module  # what the training step calls (the model itself for one process and for FSDP)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    pos: Position


def check_device(cfg: Config, ctx: DistContext) -> None:
    """Refuse combinations the device cannot run, before anything is loaded."""
    cuda = ctx.device.type == "cuda"
    needs_cuda = cuda_only(cfg)
    if needs_cuda and not cuda:
        option, instead = needs_cuda[0]
        raise DeviceError(f"{option} needs a CUDA device; {instead}")
    if cfg.optimizer == "apex-fused-sgd":
        _fused_sgd_class()  # not importable: say so now, before the data is read
    if cfg.precision == "bf16" and cuda and torch.cuda.get_device_capability(ctx.device)[0] < 8:
        log.warning("--precision bf16 on %s (compute capability < 8.0) is emulated and slow; "
                    "--precision fp16 is the fast choice on this GPU", ctx.device)


def _fused_sgd_class() -> type[torch.optim.Optimizer]:
    try:
        from apex.optimizers import FusedSGD  # NVIDIA apex, built from source; never the PyPI "apex"
    except ImportError as e:
        raise ConfigError(
            "--optimizer apex-fused-sgd needs NVIDIA apex (github.com/NVIDIA/apex, built with its CUDA "
            "extensions); it is not importable here: use --optimizer sgd"
        ) from e
    return FusedSGD


def _optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                              "nesterov": cfg.momentum > 0}
    if cfg.optimizer == "sgd" and cfg.precision == "fp16":
        return _fused_sgd(list(params), kwargs)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, **kwargs)
    try:
        return _fused_sgd_class()(params, **kwargs)
    except RuntimeError as e:  # apex imports without its CUDA extensions and fails only here
        raise ConfigError(f"--optimizer apex-fused-sgd: {e}; rebuild apex with --cuda_ext or use --optimizer sgd") from e


def _fused_sgd(params: list[nn.Parameter], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """fp16's SGD: the fused kernel applies the loss scale and skips an overflowed step itself
    (`_step_supports_amp_scaling`); with any other SGD, GradScaler.step reads found_inf with .item(), a host
    sync every step. Its first step makes the momentum buffers with torch.empty_like and fills them in the
    kernel, which returns at once on an overflow (the usual first fp16 step, at a scale of 2^16): the next step
    would read uninitialised memory. Zeroed buffers from the start give the first step's math exactly
    (0.9 * 0 + g = g) and nothing to read uninitialised."""
    optimizer = torch.optim.SGD(params, **kwargs, fused=True)
    if kwargs["momentum"] > 0:
        for p in params:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def memory_format(device: torch.device) -> torch.memory_format:
    """channels_last on CUDA (cuDNN's fast NHWC convolutions, tensor cores under autocast); NCHW elsewhere."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def _make_model(cfg: Config) -> nn.Module:
    """Same initial weights on every rank (seeded); SyncBatchNorm swapped in before the move and the DDP wrap."""
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model)
    if cfg.sync_bn:
        if not models.has_batch_norm(model):
            log.warning("--sync-bn: model %s has no BatchNorm layers; nothing to synchronise", cfg.model)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def _place(model: nn.Module, device: torch.device) -> nn.Module:
    model = model.to(device, memory_format=memory_format(device))  # type: ignore[call-overload]  # not in its stubs
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed 32x32 shapes: let cuDNN pick its fastest kernels
    return model


def build(cfg: Config, ctx: DistContext) -> TrainState:
    """Model, optimizer and scaler on this rank's device; same initial weights on every rank (seeded). FSDP
    shards the model here, before the optimizer takes its (sharded) parameters; one process keeps it whole."""
    model = _place(_make_model(cfg), ctx.device)
    if cfg.strategy == "fsdp" and ctx.distributed:
        model = parallel.shard(cfg, model)
    optimizer = _optimizer(cfg, model.parameters())  # after the move: fused optimizers need CUDA parameters
    log.info("%s: %s (grads and optimizer as of the first step)", cfg.strategy,
             parallel.expected_memory(model, optimizer).describe())
    return TrainState(model, model, optimizer, parallel.grad_scaler(cfg, ctx.device), Position())


def wrap(cfg: Config, ctx: DistContext, st: TrainState) -> None:
    """Wrap in DDP after a restore (DDP's constructor broadcasts rank 0's weights); FSDP is sharded already."""
    st.ddp = parallel.wrap(cfg, ctx, st.model)


def _rng(ctx: DistContext) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return rng


def to_checkpoint(cfg: Config, ctx: DistContext, st: TrainState, global_batch: int) -> dict[str, Any]:
    return {
        "model": st.model.state_dict(),
        "optimizer": st.optimizer.state_dict(),
        **_trainer_state(cfg, ctx, st, global_batch),
    }


def _trainer_state(cfg: Config, ctx: DistContext, st: TrainState, global_batch: int) -> dict[str, Any]:
    """Everything but the model and optimizer: for a DDP .pt and a sharded checkpoint's trainer.pt alike."""
    return {
        "scaler": st.scaler.state_dict(),
        "epoch": st.pos.epoch, "samples_in_epoch": st.pos.sample, "step": st.pos.step,
        "world_size": ctx.world_size, "global_batch": global_batch,
        # No scheduler state: the learning rate is a pure function of the position and the config (loop.lr_at).
        "rng": _rng(ctx), "config": cfg.to_dict(),
    }


def save_sharded(cfg: Config, ctx: DistContext, st: TrainState, global_batch: int) -> Path:
    """--strategy fsdp: every rank writes its shards into ckpt-<step>/ (collective)."""
    return dcp_checkpoint.save(cfg.ckpt_dir, st.model, st.optimizer, _trainer_state(cfg, ctx, st, global_batch),
                               ctx=ctx, step=st.pos.step, epoch=st.pos.epoch, epoch_complete=st.pos.sample == 0,
                               keep=cfg.keep_checkpoints)


def _load_on_main(cfg: Config, ctx: DistContext) -> tuple[dict[str, Any] | None, str | None]:
    """On global rank 0: the newest valid checkpoint (CPU tensors), or an error message."""
    info = checkpoint.newest_valid(cfg.ckpt_dir)
    sharded = dcp_checkpoint.newest_valid(cfg.ckpt_dir)
    if sharded is not None and (info is None or sharded.manifest.step > info.step):
        return None, (f"checkpoint {sharded.path} was written by --strategy fsdp (a sharded DCP folder); resume it "
                      "with --strategy fsdp, at any number of processes")
    if info is None:
        return None, (f"--resume: no valid checkpoint in {cfg.ckpt_dir}; run without --resume to start fresh, "
                      f"or point --ckpt-dir at the run to continue")
    try:
        state = checkpoint.load(info, torch.device("cpu"))
    except CheckpointError as e:
        return None, str(e)
    problem = _shape_problem(state)
    if problem is not None:
        return None, (f"checkpoint {info.path} is not one this trainer wrote ({problem}); move it away to resume "
                      "from the one before, or run without --resume")
    saved_model = state.get("config", {}).get("model")
    if saved_model != cfg.model:
        return None, f"checkpoint {info.path} was trained with --model {saved_model}, not {cfg.model}; pass --model {saved_model}"
    log.info("resuming from %s (epoch %d, step %d, world size %d)", info.path, state["epoch"], state["step"], state["world_size"])
    return {**state, "_path": str(info.path)}, None  # the path goes with the state to every rank, for errors


# What restore reads, and the type each must have (a valid sha256 proves the bytes, not that a trainer wrote them).
_STATE_FIELDS: dict[str, type] = {"model": dict, "optimizer": dict, "scaler": dict, "rng": dict, "config": dict,
                                  "epoch": int, "samples_in_epoch": int, "step": int, "world_size": int}


def _shape_problem(state: object) -> str | None:
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    for key, kind in _STATE_FIELDS.items():
        if not isinstance(state.get(key), kind):
            return f"{key!r} is missing or not of type {kind.__name__}"
    if "torch" not in state["rng"]:
        return "'rng' has no torch generator state"
    return None


def _load_scaler(scaler: torch.amp.GradScaler, saved: dict[str, Any]) -> None:
    """A disabled scaler saves {}; loading that into an enabled one raises, so an fp32/bf16 run resumed
    with --precision fp16 starts from a fresh loss scale instead."""
    if saved or not scaler.is_enabled():
        scaler.load_state_dict(saved)
    else:
        log.warning("checkpoint has no loss-scaler state (not trained in fp16): starting from a fresh scale")


def _load_into(st: TrainState, state: dict[str, Any], ctx: DistContext) -> None:
    st.model.load_state_dict(state["model"])  # copies into this rank's device tensors
    built = [{k: group[k] for k in ("fused",) if k in group} for group in st.optimizer.param_groups]
    st.optimizer.load_state_dict(state["optimizer"])  # casts the state to the parameters' device
    # The saved groups' settings replace ours, `fused` too: a bf16/fp32 checkpoint resumed in fp16 would run the
    # unfused step, which refuses the loss scale the scaler hands a fused optimizer.
    for group, ours in zip(st.optimizer.param_groups, built, strict=True):
        group.update(ours)
    _load_trainer_state(st, state, ctx)


def _load_trainer_state(st: TrainState, state: dict[str, Any], ctx: DistContext) -> None:
    _load_scaler(st.scaler, state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], ctx.device)


def restore(cfg: Config, ctx: DistContext, st: TrainState) -> int:
    """Load the newest valid checkpoint, continue from its position. Returns the global batch the checkpoint
    was trained with."""
    state = _restore_sharded(cfg, ctx, st) if cfg.strategy == "fsdp" else _restore_full(cfg, ctx, st)
    st.pos = Position(int(state["epoch"]), int(state["samples_in_epoch"]), int(state["step"]))
    if state["world_size"] != ctx.world_size:
        log.warning("checkpoint was written with world size %d, continuing with %d at sample %d of epoch %d",
                    state["world_size"], ctx.world_size, st.pos.sample, st.pos.epoch + 1)
    return int(state.get("global_batch", 0))


def _restore_sharded(cfg: Config, ctx: DistContext, st: TrainState) -> dict[str, Any]:
    """Every rank reads its own shards from the folder, resharded to this run's world size."""
    state = dcp_checkpoint.restore(cfg, ctx, st.model, st.optimizer)
    _load_trainer_state(st, state, ctx)
    return state


def _restore_full(cfg: Config, ctx: DistContext, st: TrainState) -> dict[str, Any]:
    """Rank 0 reads the .pt and shares it with every rank."""
    payload: list[Any] = [None, None]
    if ctx.is_main:
        payload = list(_load_on_main(cfg, ctx))
    if ctx.distributed:
        # Pickled through a byte tensor on this process's own device (NCCL needs it on our GPU).
        tdist.broadcast_object_list(payload, src=0, device=ctx.device)
    state, err = payload
    if err is not None:
        raise CheckpointError(err)
    try:
        _load_into(st, state, ctx)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:  # fields of the right type, content that is not
        raise CheckpointError(f"checkpoint {state.get('_path', '?')} does not fit this run's model or optimizer "
                              f"({str(e).splitlines()[0][:200]}); point --ckpt-dir at this model's run, "
                              "or run without --resume") from None
    return dict(state)
