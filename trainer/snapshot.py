"""A run's training state in a checkpoint and back: what a checkpoint holds (model, optimizer, scaler, position,
RNG, config), saved by checkpoint.py (a DDP .pt) or dcp_checkpoint.py (an FSDP folder), and restored on --resume.

Restoring a DDP checkpoint goes through global rank 0: only rank 0 reads the checkpoint dir (other nodes may not
have it), loads to the CPU and broadcasts; every rank then copies into its own device's tensors, so nothing ever
lands on another rank's GPU. FSDP checkpoints are folders every rank reads its own shards from (dcp_checkpoint.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from . import checkpoint, dcp_checkpoint
from .config import Config
from .dist import DistContext
from .errors import CheckpointError
from .state import Position, TrainState

log = logging.getLogger(__name__)


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


def off_device(obj: Any) -> Any:
    """A copy of a checkpoint's state with every tensor copied to the CPU, even those on it already: training
    goes on changing its tensors in place while a background thread writes this copy."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: off_device(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(off_device(v) for v in obj)
    return obj


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


def start_sharded(cfg: Config, ctx: DistContext, st: TrainState, global_batch: int,
                  group: tdist.ProcessGroup | None) -> dcp_checkpoint.PendingShards | None:
    """--strategy fsdp, asynchronous: every rank's shards copied to the CPU, then written by DCP in the
    background (collective); None when this step is saved already."""
    return dcp_checkpoint.start_save(cfg.ckpt_dir, st.model, st.optimizer,
                                     off_device(_trainer_state(cfg, ctx, st, global_batch)), ctx=ctx,
                                     step=st.pos.step, epoch=st.pos.epoch, epoch_complete=st.pos.sample == 0,
                                     keep=cfg.keep_checkpoints, group=group)


def _load_on_main(cfg: Config, ctx: DistContext) -> tuple[dict[str, Any] | None, str | None]:
    """On global rank 0: the newest valid checkpoint (CPU tensors), or an error message."""
    info = checkpoint.newest_valid(cfg.ckpt_dir)
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


def restore(cfg: Config, ctx: DistContext, st: TrainState, names: list[str] | None = None) -> int:
    """Load the newest valid checkpoint, whichever strategy wrote it, and continue from its position (collective).
    A DCP folder (FSDP, --pp) loads by parameter name into any layout, resharded by DCP. A DDP .pt loads into the
    whole model as saved (`names` None), or by name into a part of the model or its shards (`names`: the full
    model's parameter names in its parameters' order, by which the .pt's optimizer state is indexed). Returns the
    global batch the checkpoint was trained with."""
    if _newest_is_sharded(cfg, ctx):
        return _continue(ctx, st, _restore_sharded(cfg, ctx, st))
    if names is None:
        return _continue(ctx, st, _restore_full(cfg, ctx, st))
    state = _shared_full_state(cfg, ctx)
    try:
        _load_by_name(st, state, names)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {state.get('_path', '?')} does not fit this run's model or optimizer "
                              f"({str(e).splitlines()[0][:200]}); point --ckpt-dir at this model's run") from None
    _load_trainer_state(st, state, ctx)
    return _continue(ctx, st, state)


def _newest_is_sharded(cfg: Config, ctx: DistContext) -> bool:
    """Global rank 0's answer, on every rank: is the newest valid checkpoint a DCP folder (not a .pt)? Neither:
    False, and the .pt path says that nothing is there."""
    newest: list[Any] = [False]
    if ctx.is_main:
        full, sharded = checkpoint.newest_valid(cfg.ckpt_dir), dcp_checkpoint.newest_valid(cfg.ckpt_dir)
        newest = [sharded is not None and (full is None or sharded.manifest.step >= full.step)]
    if ctx.distributed:
        tdist.broadcast_object_list(newest, src=0, device=ctx.device)
    return bool(newest[0])


def _load_by_name(st: TrainState, state: dict[str, Any], names: list[str]) -> None:
    """The .pt's parameters and their optimizer state (keyed by index in `names`' order) into `st`'s part of the
    model, by full name; set_state_dict puts full tensors into FSDP's shards too."""
    # imported here, not at the top: DCP costs every process 0.7 s of CPU at its start (dcp_checkpoint.py)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    held = {n for n, _ in st.model.named_parameters()}
    saved = state["optimizer"]
    optim_state: Any = {"state": {names[i]: v for i, v in saved["state"].items() if names[i] in held},
                   "param_groups": [{**group, "params": [names[i] for i in group["params"] if names[i] in held]}
                                    for group in saved["param_groups"]]}
    model_state = {k: v for k, v in state["model"].items() if k in st.model.state_dict()}
    # This run's group settings are kept, as a DCP restore keeps them: a DDP .pt's groups say fused=True, which
    # FSDP's DTensor parameters cannot step with (optim.py); the config sets the rest alike, the loop the rate.
    own = [{k: v for k, v in group.items() if k != "params"} for group in st.optimizer.param_groups]
    set_state_dict(st.model, st.optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
    for group, settings in zip(st.optimizer.param_groups, own, strict=True):
        group.update(settings)


def _continue(ctx: DistContext, st: TrainState, state: dict[str, Any]) -> int:
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


def _shared_full_state(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    """The newest .pt as global rank 0 reads it, on every rank (CPU tensors), or the CheckpointError it met."""
    payload: list[Any] = [None, None]
    if ctx.is_main:
        payload = list(_load_on_main(cfg, ctx))
    if ctx.distributed:
        # Pickled through a byte tensor on this process's own device (NCCL needs it on our GPU).
        tdist.broadcast_object_list(payload, src=0, device=ctx.device)
    state, err = payload
    if err is not None:
        raise CheckpointError(err)
    return dict(state)


def _restore_full(cfg: Config, ctx: DistContext, st: TrainState) -> dict[str, Any]:
    """Rank 0 reads the .pt and shares it with every rank."""
    state = _shared_full_state(cfg, ctx)
    try:
        _load_into(st, state, ctx)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:  # fields of the right type, content that is not
        raise CheckpointError(f"checkpoint {state.get('_path', '?')} does not fit this run's model or optimizer "
                              f"({str(e).splitlines()[0][:200]}); point --ckpt-dir at this model's run, "
                              "or run without --resume") from None
    return dict(state)
