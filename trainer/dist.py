"""The distributed context, read from torchrun's environment; the same code runs for 1 and N processes."""

from __future__ import annotations

import datetime
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import transport
from .contract import ENV_LOG_DIR
from .errors import DeviceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE): FSDP's HSDP layout shards within a node."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return choose_backend(self.device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def choose_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors (gloo cannot reduce them in place on the GPU), gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise DeviceError(f"environment variable {name}={raw!r} is not an integer (set by torchrun?)") from e


def context_from_env(device_pref: str, legacy_local_rank: int | None = None) -> DistContext:
    """Rank, local rank and world size from torchrun's variables (defaults: one process); pick the device."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", legacy_local_rank if legacy_local_rank is not None else 0)
    if not 0 <= rank < world:
        raise DeviceError(f"RANK={rank} is outside WORLD_SIZE={world}: check the launcher's --nnodes/--node_rank")
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    return DistContext(rank, local_rank, world, _pick_device(device_pref, local_rank), local_world)


def _pick_device(pref: str, local_rank: int) -> torch.device:
    has_cuda = torch.cuda.is_available()
    if pref == "cpu" or (pref == "auto" and not has_cuda):
        return torch.device("cpu")
    if not has_cuda:
        raise DeviceError("--device cuda was requested but CUDA is not available here; use --device cpu or auto")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"local rank {local_rank} needs GPU {local_rank} but only {count} are visible: "
            f"lower --nproc_per_node to {count}"
        )
    return torch.device("cuda", local_rank)


def init_kwargs(ctx: DistContext, timeout_s: float) -> dict[str, Any]:
    """Arguments of init_process_group. The timeout bounds every collective: gloo raises, NCCL's watchdog
    tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default 3, torchrun's 1 and the
    image's 3 all do), so a lost peer ends the job instead of hanging it."""
    kwargs: dict[str, Any] = {"backend": ctx.backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if ctx.device.type == "cuda":
        # Binds the group to our GPU and forms the NCCL communicator now: setup errors surface here, and
        # barrier()/object collectives use this device instead of guessing (no stray context on cuda:0).
        kwargs["device_id"] = ctx.device
    return kwargs


def init(ctx: DistContext, timeout_s: float) -> None:
    """Select this process's GPU, then join the process group (env:// rendezvous from torchrun)."""
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)  # before any CUDA work or NCCL init, or it all lands on cuda:0
    if not ctx.distributed:
        return
    # Rank 0 asks NCCL to say which transport it picks (IB, RoCE, sockets): NCCL reads its log settings once,
    # when it starts, and says it only there.
    nccl_log = transport.before_nccl(Path(os.environ.get(ENV_LOG_DIR) or tempfile.gettempdir())) \
        if ctx.is_main and ctx.backend == "nccl" else None
    dist.init_process_group(**init_kwargs(ctx, timeout_s))
    log.info("process group up: backend=%s world_size=%d timeout=%ss", ctx.backend, ctx.world_size, timeout_s)
    if ctx.is_main and ctx.backend == "nccl":
        transport.report_nccl(nccl_log)
    elif ctx.is_main:
        log.info("transport: %s", transport.describe_gloo(dict(os.environ)))


def checkpoint_group(ctx: DistContext, timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group of all ranks for DCP's background saves (collective): their collectives run in DCP's own
    thread, and must neither interleave with training's on the default group nor need NCCL (async_save asks
    for a CPU backend). A lost peer fails them after --dist-timeout, as any collective. None for one process."""
    if not ctx.distributed:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank if it is True on any rank (all_reduce MAX): all ranks take the same branch."""
    return any_ranks(ctx, flag)[0]


def any_ranks(ctx: DistContext, *flags: bool) -> tuple[bool, ...]:
    """Several flags agreed in one all_reduce (MAX): one collective per step, whatever the number of flags."""
    if not ctx.distributed:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def wait_for_peers(ctx: DistContext, t: torch.Tensor) -> list[float]:
    """All-reduce (MAX) a tensor and read it: the host's one wait per agreement (trainer/pace.py's Cadence). On a GPU the
    read waits for every queued kernel and for the collective, so a rank whose peer is lost blocks here, in a
    frame the stall report recognises by its name (contract.PEER_WAIT_FUNCTION)."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


class Agreement(NamedTuple):
    """What one agreement returns, the same on every rank."""

    flags: tuple[bool, ...]  # each True if True on any rank
    diverged: bool  # some rank's loss is non-finite
    slowest_step_s: float  # the largest `step_s` any rank sent
    times: list[float]  # every rank's `times`, rank r's at r * len(times)


def agree(ctx: DistContext, loss: torch.Tensor, *flags: bool, step_s: float = 0.0,
          times: Sequence[float] = ()) -> Agreement:
    """The flags agreed over all ranks, whether any rank's `loss` is non-finite, the largest `step_s`, and every
    rank's `times` (this rank's in its own slots; the others' slots are 0 on each rank, so MAX gathers them): one
    all_reduce, one read. The tensor is filled on the device, element by element (no copy from the host: that
    would be a second wait); float64 keeps the 0/1 flags exact."""
    head = len(flags) + 2
    t = torch.zeros(head + len(times) * ctx.world_size, dtype=torch.float64, device=loss.device)
    for i, flag in enumerate(flags):
        if flag:
            t[i] = 1
    t[len(flags)] = (~torch.isfinite(loss)).any()
    t[len(flags) + 1] = step_s
    base = head + ctx.rank * len(times)
    for i, value in enumerate(times):
        t[base + i] = value
    values = wait_for_peers(ctx, t)
    return Agreement(tuple(v > 0 for v in values[:len(flags)]), values[len(flags)] > 0, values[len(flags) + 1],
                     values[head:])


def sum_tensor(ctx: DistContext, t: torch.Tensor) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


_COMM_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset|refused)|broken pipe", re.IGNORECASE)


def is_communication_failure(exc: BaseException) -> bool:
    """A collective failed because a peer is gone (timeout, closed connection), not because of a bug."""
    if isinstance(exc, dist.DistError):
        return True
    return dist.is_available() and dist.is_initialized() and bool(_COMM_FAILURE.search(str(exc)))
