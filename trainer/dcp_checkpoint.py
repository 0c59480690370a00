"""Sharded checkpoints for --strategy fsdp: one folder per step in torch.distributed.checkpoint (DCP) format.

The layout is in contract.py. Every rank writes its own shards into .ckpt-<step>.tmp/ (DCP fsyncs each file);
global rank 0 then adds trainer.pt (scaler, RNG, position, config) and manifest.json (every file's size and
sha256), fsyncs the folder and renames it to ckpt-<step>. A kill at any moment leaves either the previous set
of valid checkpoints or that set plus the new one. DCP records where every chunk of every tensor lies, so a
checkpoint written by N processes loads into any number of processes, resharded as it is read.

On several nodes each node has its own --ckpt-dir: a rank whose shard file global rank 0 does not see sends it
over the process group, and rank 0 writes it into its folder before sealing, so node 0 holds one complete
checkpoint (the orchestrator copies it to node 1, to --ckpt-mirror and, before a resume, to every node: a
resharded load reads chunks from any rank's file). On one machine or a shared filesystem nothing is sent.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as tdist
from torch import nn

from . import checkpoint, dist
from .atomic import fsync_dir
from .config import Config
from .contract import (
    CKPT_FOLDER_RE,
    SHARDED_MANIFEST,
    SHARDED_TMP_RE,
    SHARDED_TRAINER_FILE,
    ShardedManifest,
    ckpt_folder_name,
    ckpt_tmp_name,
)
from .dist import DistContext
from .errors import CheckpointError

if TYPE_CHECKING:
    # DCP is imported where a sharded checkpoint is written or read, not here: a DDP rank reads only this module's
    # manifests. With the lazy pipelining import, 0.1 s of CPU less at each DDP rank's start (measured; DCP alone
    # costs 0.7 s on top of torch, but torch._dynamo, which every optimizer imports, brings much of it anyway).
    import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ShardedInfo:
    path: Path
    manifest: ShardedManifest


def _write_synced(path: Path, blob: bytes) -> None:
    with path.open("wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names, each rank's shards as DTensors: what DCP reshards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


# ---- save (every rank) -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardedSave:
    """One save: what sealing it needs once every rank's shards are written."""

    folder: Path
    trainer_state: dict[str, Any]
    step: int
    epoch: int
    epoch_complete: bool
    keep: int
    started: float


@dataclass(frozen=True)
class PendingShards:
    """A save that completes in the background: DCP writes the shards (async_save), then the same background
    thread gathers other nodes' shards and, on global rank 0, seals (trainer.pt, sha256 of every file, manifest,
    fsyncs, rename) and prunes. `sealed`: that thread's outcome on this rank (the final folder)."""

    save: ShardedSave
    sealed: Future[Path]


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], *,
         ctx: DistContext, step: int, epoch: int, epoch_complete: bool, keep: int) -> Path:
    """Write ckpt-<step>/ (collective: call on every rank); prune beyond `keep`. Raises CheckpointError on
    every rank alike."""
    if _prepare(folder, ctx, step):
        return folder / ckpt_folder_name(step)
    import torch.distributed.checkpoint as dcp
    t0 = time.monotonic()
    _shards_written(folder, step, lambda: dcp.save(_state(model, optimizer), storage_writer=_writer(folder, step)))
    return _complete(ctx, ShardedSave(folder, trainer_state, step, epoch, epoch_complete, keep, t0))


def start_save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], *,
               ctx: DistContext, step: int, epoch: int, epoch_complete: bool, keep: int,
               group: tdist.ProcessGroup | None) -> PendingShards | None:
    """Collective: every rank copies its shards to the CPU (DCP's blocking stager: the only pause), then DCP
    writes them in its own thread, with its collectives on `group` (a gloo group of its own, so they never
    interleave with training's); finish_save completes it. None: this step is already saved."""
    if _prepare(folder, ctx, step):
        return None
    import torch.distributed.checkpoint as dcp
    t0 = time.monotonic()
    # FileSystemWriter is DCP's BlockingAsyncStager: the copy is done when async_save returns, which then gives
    # a plain Future of the write (an AsyncSaveResponse only comes with an asynchronous stager).
    written = cast(Future, _shards_written(folder, step, lambda: dcp.async_save(
        _state(model, optimizer), storage_writer=_writer(folder, step), process_group=group)))
    log.info("sharded checkpoint of step %d copied off the device (training paused %.3f s), writing in the "
             "background", step, time.monotonic() - t0)
    save = ShardedSave(folder, trainer_state, step, epoch, epoch_complete, keep, t0)
    sealed: Future[Path] = Future()
    threading.Thread(target=_complete_in_background, args=(ctx, save, written, group, sealed),
                     name=f"seal-ckpt-{step}", daemon=True).start()
    return PendingShards(save, sealed)


def _complete_in_background(ctx: DistContext, save: ShardedSave, written: Future[Any],
                            group: tdist.ProcessGroup | None, sealed: Future[Path]) -> None:
    """The seal thread: DCP's write done, the gather on the checkpoint group (gloo, CPU tensors: never
    interleaved with training's collectives on the default group), then global rank 0 seals and prunes; the
    outcome into `sealed`. Only one save is in flight, so DCP's own collectives on that group are over."""
    try:
        _shards_written(save.folder, save.step, written.result)
        final, tmp = save.folder / ckpt_folder_name(save.step), save.folder / ckpt_tmp_name(save.step)
        _gather_shards(ctx, tmp, group=group, device=torch.device("cpu"))
        if ctx.is_main:
            _seal_and_prune(ctx, save, tmp, final)
        sealed.set_result(final)
    except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
        sealed.set_exception(e)


def finish_save(pending: PendingShards, ctx: DistContext, timeout_s: float) -> Path:
    """Collective: wait for this rank's background write, gather and seal; every rank learns whether every rank's
    part worked (rank 0's seal above all), as after a synchronous save."""
    done, err = pending.save, None
    try:
        path = pending.sealed.result(timeout_s)
    except TimeoutError:
        err = CheckpointError(f"the sharded checkpoint of step {done.step} was still being written after "
                              f"{timeout_s:g} s (a stalled disk under --ckpt-dir?)")
    except CheckpointError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - the gather's collective failed (a lost peer): every rank must learn it
        err = CheckpointError(f"the sharded checkpoint of step {done.step} did not complete: {type(e).__name__}: {e}")
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("another rank could not complete the sharded checkpoint; see its error line")
    return path


def _writer(folder: Path, step: int) -> dcp.FileSystemWriter:
    import torch.distributed.checkpoint as dcp
    return dcp.FileSystemWriter(folder / ckpt_tmp_name(step), sync_files=True)  # DCP fsyncs each file


def _prepare(folder: Path, ctx: DistContext, step: int) -> bool:
    """Rank 0 makes a fresh temporary folder; True when this step is already saved (e.g. SIGTERM right after a
    save of it). Collective: every rank gets rank 0's answers."""
    final, tmp = folder / ckpt_folder_name(step), folder / ckpt_tmp_name(step)
    exists, failed = False, False
    if ctx.is_main:
        exists = _validate(final, warn=False) is not None
        failed = not exists and not _fresh_folder(tmp)
    exists, failed = dist.any_ranks(ctx, exists, failed)  # rank 0's answers, on every rank
    if failed:
        raise CheckpointError(f"cannot create {tmp}; fix the permissions of --ckpt-dir or choose another")
    return exists


def _shards_written(folder: Path, step: int, write: Callable[[], T]) -> T:
    import torch.distributed.checkpoint as dcp
    try:
        return write()
    except dcp.CheckpointException as e:  # a BaseException; DCP raises it on every rank when any rank failed
        raise CheckpointError(f"cannot write sharded checkpoint {folder / ckpt_tmp_name(step)}: {_first_failure(e)}; "
                              "free space or fix --ckpt-dir; the previous checkpoints are intact") from None


def _complete(ctx: DistContext, p: ShardedSave) -> Path:
    """Every rank's shards are written: gather them on global rank 0, which seals and prunes (collective)."""
    final, tmp = p.folder / ckpt_folder_name(p.step), p.folder / ckpt_tmp_name(p.step)
    _gather_shards(ctx, tmp)
    err = None
    if ctx.is_main:
        try:
            _seal_and_prune(ctx, p, tmp, final)
        except CheckpointError as e:
            err = e
    if dist.any_rank(ctx, err is not None):
        raise err or CheckpointError("global rank 0 could not complete the sharded checkpoint; see its error line")
    return final


def _seal_and_prune(ctx: DistContext, p: ShardedSave, tmp: Path, final: Path) -> None:
    _seal(p.folder, tmp, final, p.trainer_state, ctx.world_size, p.step, p.epoch, p.epoch_complete)
    prune(p.folder, p.keep)
    log.info("sharded checkpoint %s (%d processes, %.2f s)", final, ctx.world_size, time.monotonic() - p.started)


SEND_CHUNK = 64 << 20  # bytes per point-to-point message: a large shard never sits in memory twice


def _gather_shards(ctx: DistContext, tmp: Path, group: tdist.ProcessGroup | None = None,
                   device: torch.device | None = None) -> None:
    """Collective on `group` (None: the default one), its tensors on `device` (None: this rank's): global rank 0
    names the ranks whose shard files it does not see in `tmp` (another node's --ckpt-dir); each of them sends its
    files to rank 0, rank by rank, then removes its local copy."""
    if not ctx.distributed:
        return
    dev = device or ctx.device
    missing: list[Any] = [[r for r in range(ctx.world_size) if not any(tmp.glob(f"__{r}_*.distcp"))]
                          if ctx.is_main else None]
    tdist.broadcast_object_list(missing, src=0, group=group, device=dev)
    for rank in missing[0]:
        if ctx.rank == rank:
            _send_shards(ctx, tmp, group, dev)
        elif ctx.is_main:
            _receive_shards(ctx, tmp, rank, group, dev)


def _send_shards(ctx: DistContext, tmp: Path, group: tdist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
    dev = device or ctx.device
    files = sorted(tmp.glob(f"__{ctx.rank}_*.distcp"))
    tdist.send_object_list([[(p.name, p.stat().st_size) for p in files]], dst=0, group=group, device=dev)
    for path in files:
        with path.open("rb") as f:
            while block := f.read(SEND_CHUNK):
                tdist.send(torch.frombuffer(bytearray(block), dtype=torch.uint8).to(dev), dst=0, group=group)
        path.unlink()
    try:
        tmp.rmdir()  # the last rank of this node to send removes the folder
    except OSError:
        pass


def _receive_shards(ctx: DistContext, tmp: Path, rank: int, group: tdist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> None:
    dev = device or ctx.device
    header: list[Any] = [None]
    tdist.recv_object_list(header, src=rank, group=group, device=dev)
    for name, size in header[0]:
        with (tmp / name).open("wb") as f:
            left = size
            while left > 0:
                block = torch.empty(min(SEND_CHUNK, left), dtype=torch.uint8, device=dev)
                tdist.recv(block, src=rank, group=group)
                f.write(block.cpu().numpy().tobytes())
                left -= block.numel()
            f.flush()
            os.fsync(f.fileno())


def _fresh_folder(tmp: Path) -> bool:
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    except OSError:
        return False
    return True


def _first_failure(e: dcp.CheckpointException) -> str:
    failures = getattr(e, "failures", {}) or {}
    for rank, exc in failures.items():
        return f"rank {rank}: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
    return str(e).splitlines()[0][:200]


def _seal(folder: Path, tmp: Path, final: Path, trainer_state: dict[str, Any], world: int, step: int,
          epoch: int, epoch_complete: bool) -> None:
    """Global rank 0, after every rank's shards are on disk: trainer.pt, manifest.json, rename into place."""
    try:
        blob = _torch_bytes(trainer_state)
        _write_synced(tmp / SHARDED_TRAINER_FILE, blob)
        missing = [r for r in range(world) if not any(tmp.glob(f"__{r}_*.distcp"))]
        if missing:
            raise CheckpointError(f"the shards of rank(s) {missing} did not reach {tmp}; free space in "
                                  "--ckpt-dir on every node")
        files = {p.name: (p.stat().st_size, checkpoint.sha256_file(p)) for p in sorted(tmp.iterdir()) if p.is_file()}
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        manifest = ShardedManifest(files, step, epoch, epoch_complete, world, created)
        _write_synced(tmp / SHARDED_MANIFEST, json.dumps(manifest.to_dict(), indent=1).encode())
        fsync_dir(tmp)
        if final.exists():
            _replace_folder(tmp, final)
        else:
            os.replace(tmp, final)
        fsync_dir(folder)
    except OSError as e:
        raise CheckpointError(f"cannot write sharded checkpoint {final}: {e.strerror or e}; free space or fix "
                              "--ckpt-dir; the previous checkpoints are intact") from e


def _replace_folder(tmp: Path, final: Path) -> None:
    """An invalid folder of the same step (a copy cut short): move it aside first, a folder cannot be renamed
    over a non-empty one."""
    stale = final.with_name(f".{final.name}.stale.tmp")
    shutil.rmtree(stale, ignore_errors=True)
    os.replace(final, stale)
    os.replace(tmp, final)
    shutil.rmtree(stale, ignore_errors=True)


def _torch_bytes(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- find, validate, prune (global rank 0) ------------------------------------------------------------------------

def _validate(path: Path, warn: bool = True) -> ShardedInfo | None:
    """The checkpoint in this folder, or None (with a warning naming it) if it is not valid."""
    manifest_path = path / SHARDED_MANIFEST
    if not path.is_dir():
        return None
    why = None
    try:
        manifest = ShardedManifest.parse(json.loads(manifest_path.read_text()))
        problems = (checkpoint.file_problem(path / name, size, sha) for name, (size, sha) in manifest.files.items())
        why = next((p for p in problems if p is not None), None)
    except (OSError, ValueError) as e:
        why = f"no readable manifest ({e})"
    if why is not None:
        if warn:
            log.warning("skipping invalid sharded checkpoint %s: %s", path, why)
        return None
    return ShardedInfo(path, manifest)


def _folder_steps(folder: Path) -> list[int]:
    found = [CKPT_FOLDER_RE.fullmatch(p.name) for p in folder.iterdir()] if folder.is_dir() else []
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def newest_valid(folder: Path) -> ShardedInfo | None:
    """The valid folder checkpoint with the highest step; newer invalid ones are skipped with a warning."""
    for step in _folder_steps(folder):
        info = _validate(folder / ckpt_folder_name(step))
        if info is not None:
            return info
    return None


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` step folders, and the temporary folders of killed saves."""
    for step in _folder_steps(folder)[keep:]:
        shutil.rmtree(folder / ckpt_folder_name(step), ignore_errors=True)
    for p in folder.iterdir():
        if SHARDED_TMP_RE.fullmatch(p.name):  # only rank 0 renames, after every rank wrote: none is live now
            shutil.rmtree(p, ignore_errors=True)


# ---- restore (every rank) -----------------------------------------------------------------------------------------

def _find_on_main(cfg: Config) -> tuple[str | None, str | None]:
    """Global rank 0: the folder to resume from (snapshot.restore chose this format: it is the newest), or an
    error message."""
    sharded = newest_valid(cfg.ckpt_dir)
    if sharded is None:
        return None, (f"--resume: no valid sharded checkpoint in {cfg.ckpt_dir}; run without --resume to start "
                      "fresh, or point --ckpt-dir at the run to continue")
    m = sharded.manifest
    log.info("resuming from %s (epoch %d, step %d, saved by %d processes)", sharded.path, m.epoch, m.step, m.world_size)
    return str(sharded.path), None


def restore(cfg: Config, ctx: DistContext, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the newest valid folder checkpoint into this run's shards, whatever world size wrote it (collective).
    Returns trainer.pt's content (scaler, RNG, position, world size, global batch, config)."""
    payload: list[Any] = [None, None]
    if ctx.is_main:
        payload = list(_find_on_main(cfg))
    if ctx.distributed:
        tdist.broadcast_object_list(payload, src=0, device=ctx.device)
    where, err = payload
    if err is not None:
        raise CheckpointError(err)
    path = Path(where)
    try:
        meta = torch.load(path / SHARDED_TRAINER_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  # a node whose --ckpt-dir is not the shared one, or a bad file
        raise CheckpointError(f"cannot read {path / SHARDED_TRAINER_FILE} on rank {ctx.rank}: "
                              f"{str(e).splitlines()[0][:200]}; every rank must see the same --ckpt-dir") from None
    saved_model = meta.get("config", {}).get("model")
    if saved_model != cfg.model:
        raise CheckpointError(f"checkpoint {path} was trained with --model {saved_model}, not {cfg.model}; "
                              f"pass --model {saved_model}")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = _state(model, optimizer)
    # The optimizer's param_groups are loaded as DCP's other non-tensor values: one copy, whichever rank's got
    # saved. Each group's "params" lists the saving rank's own parameter names, and the ranks of a pipeline hold
    # different ones, so a rank would get another stage's names and its groups would lose their settings (SGD then
    # fails on group["momentum"]). This run's own groups are kept: their settings come from the same config, and
    # the loop sets the learning rate every step.
    own_groups = copy.deepcopy(state["optim"]["param_groups"])  # dcp.load writes into the groups in place
    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"checkpoint {path} does not fit this run's model or optimizer "
                              f"({_first_failure(e)}); point --ckpt-dir at this model's run") from None
    state["optim"]["param_groups"] = own_groups
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(meta)
