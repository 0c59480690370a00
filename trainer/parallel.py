"""How the model is spread over the processes: DDP (a full replica per process) or FSDP2 (fully_shard: each
process holds 1/world of the parameters, gradients and optimizer state). The same code runs on gloo and NCCL.

FSDP's choices, written down:
- fully_shard is applied to every residual block of this project's models (models.BLOCK_TYPES: the CIFAR ResNets'
  BasicBlock, the ViT's Block), then to the root. A block is the unit whose parameters are all-gathered for its
  forward and freed after it. A torchvision model (--model resnet50 ...) has none of these blocks: it is one
  unit, the root, whose whole parameters are all-gathered for the forward (its state is still sharded at rest).
- reshard_after_forward: True for every block but the last, whose parameters backward needs right away
  (freeing and all-gathering them again would only add a collective); the root keeps FSDP's own heuristic
  (not resharded: its stem and head run first in backward too). True frees each block's full parameters
  between forward and backward, which is what lets a model that does not fit as a whole train at all.
- Mixed precision: MixedPrecisionPolicy(param_dtype=bf16|fp16) all-gathers and computes in the low dtype;
  reduce_dtype stays fp32 so gradients are summed without rounding (the sharded fp32 parameters are the master
  copy). The loop's autocast still runs on top: it keeps loss and normalisation in fp32.
- fp16's gradient scaler is ShardedGradScaler when there is a process group: each rank sees only its shard of the
  gradients, so an inf found on one rank must skip the step on every rank, and ShardedGradScaler all-reduces
  found_inf itself. (With FSDP2's DTensor gradients, torch 2.13's DTensor dispatch also reduces found_inf for the
  plain GradScaler, as measured; the explicit scaler does not depend on that.) One process without a group has
  an unsharded model: the plain GradScaler (grad_scaler).
"""

from __future__ import annotations

import inspect
import logging
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from . import models, precision
from .config import Config
from .dist import DistContext

if typing.TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

log = logging.getLogger(__name__)
# FSDP (torch.distributed.fsdp, which pulls in DTensor and its ops) is imported where a model is sharded, not here,
# so that importing the trainer does not: 0.6 s of CPU alone (1.7 s with it, 1.1 s for torch, in the CPU image). A
# training rank imports it anyway once it builds an optimizer (torch._dynamo, which torch's optimizers and DDP import,
# imports FSDP), so this saves start-up only together with the lazy DCP and pipelining imports (0.1 s a DDP rank,
# measured). FSDP_MODULE is where it lives once imported.
FSDP_MODULE = "torch.distributed.fsdp"


def is_fully_sharded(module: nn.Module) -> typing.TypeGuard[FSDPModule]:
    """Whether `module` is FSDP2's (fully_shard applied to it), without importing FSDP: a module can be one only
    once FSDP has been imported."""
    fsdp = sys.modules.get(FSDP_MODULE)
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


# torch 2.13 renamed DDP's broadcast_buffers (now deprecated, with a FutureWarning) to forward_sync_buffers; older
# releases (the GPU machines' 2.11) know only broadcast_buffers. False means the same in both: no broadcast of
# rank 0's buffers before each forward.
_FORWARD_SYNC_KW = ("forward_sync_buffers" if "forward_sync_buffers" in
                    inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


def ddp_kwargs(device: torch.device) -> dict[str, Any]:
    """One GPU per process: DDP needs its index (device_ids, output_device); CPU modules take none.
    No broadcast of rank 0's buffers before each forward: a collective per step for BatchNorm's running
    statistics, which no training step reads (the forward normalises with the batch's own). Evaluation
    broadcasts rank 0's buffers itself (loop.evaluate), and checkpoints hold rank 0's; with SyncBatchNorm they
    are equal anyway. Gradients as views into DDP's buckets: after the all-reduce each .grad is its bucket's slice,
    so nothing is copied back out of the bucket and no second gradient-sized buffer is kept between steps. Each
    backward still copies every fresh gradient INTO its bucket: the loop's zero_grad(set_to_none=True) drops the
    views, so autograd makes new gradients (torch's DDP docs, under batched_grad_copy: "gradient_as_bucket_view
    alone cannot avoid copies because the bucket view alias is destroyed every iteration"). Keeping the views
    (set_to_none=False) would trade that copy for a zeroing of every gradient each step: no fewer bytes moved."""
    kwargs: dict[str, Any] = {_FORWARD_SYNC_KW: False, "gradient_as_bucket_view": True}
    if device.type == "cuda":
        kwargs.update(device_ids=[device.index], output_device=device.index)
    return kwargs


def _divide_then_compress(dtype: torch.dtype) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """A DDP hook that sends the bucket in `dtype`, divided by the world size BEFORE the cast.

    torch's default_hooks.fp16_compress_hook does `buffer.to(float16).div_(world)`: under fp16 loss scaling
    (2**16 at the start) a scaled gradient above 65504 becomes inf in the cast, before the division that would
    have brought it back in range, and the scaler then skips the step. Dividing first keeps every value that
    the mean itself can hold."""

    def hook(process_group: tdist.ProcessGroup | None, bucket: tdist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else tdist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.div(tdist.get_world_size(group)).to(dtype)

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(fut.value()[0])  # in place: no second full-size buffer
            return buffer

        return tdist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)

    # DDP compares the annotations themselves with dist.GradBucket and Future[Tensor]; this module's are strings.
    hook.__annotations__ = typing.get_type_hints(hook)
    return hook


def comm_hook(compression: str) -> Callable[..., Any] | None:
    """The DDP communication hook for --grad-compression: gradients travel in 16 bits, are summed, cast back."""
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    return _divide_then_compress(dtypes[compression]) if compression in dtypes else None


def wrap_ddp(cfg: Config, ctx: DistContext, model: nn.Module) -> nn.Module:
    if not ctx.distributed:
        return model
    # The model is already SyncBN-converted, on its device and in its memory format: DDP builds its
    # gradient buckets from the parameters as they are now. Its constructor broadcasts rank 0's weights.
    ddp = DistributedDataParallel(model, **ddp_kwargs(ctx.device))
    hook = comm_hook(cfg.grad_compression)
    if hook is not None:
        ddp.register_comm_hook(None, hook)  # before the first backward; None: the default process group
    return ddp


def mp_policy(precision_name: str) -> MixedPrecisionPolicy:
    """fp32: FSDP's default (no casts). bf16/fp16: compute and all-gather in that dtype, reduce in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if precision_name == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.precision_plan(precision_name).autocast_dtype,
                                reduce_dtype=torch.float32)


def norm_policy(precision_name: str) -> MixedPrecisionPolicy:
    """BatchNorm's own policy: weights kept in fp32 (no param_dtype), output cast to the job's dtype.

    Under the job's policy BatchNorm's weight and bias would be cast to bf16/fp16 while its running statistics,
    buffers that FSDP never casts, stay fp32: the first step then fails with `expected scalar type BFloat16 but
    found Float`. PyTorch's own test_fully_shard_mixed_precision.py (`_test_norm_modules`) expects that error and
    gives the norm module this policy instead (torchtitan#674 is the same report)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if precision_name == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(output_dtype=precision.precision_plan(precision_name).autocast_dtype,
                                reduce_dtype=torch.float32)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The residual blocks of the model, in forward order: each becomes one FSDP unit."""
    return [m for m in model.modules() if isinstance(m, models.BLOCK_TYPES)]


def batch_norm_groups(model: nn.Module, units: list[nn.Module]) -> list[list[nn.Module]]:
    """Every BatchNorm layer of the model in one FSDP group (none when it has none): one all-gather in the first
    norm's forward and one reduce-scatter at the end of backward (under HSDP one cross-node all-reduce) per step,
    where a group per block cost one of each per block (resnet18: 9). FSDP2 shards a list of modules as one group
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _register_group_forward_hooks): its all-gather runs
    before the first of them to run forward, and its post-backward hook sits on that first module's inputs, so
    the reduce-scatter waits until every norm's gradient is in. The norms are a few KiB per block: holding them
    all unsharded through the step costs nothing next to one block's convolutions. `units` (the blocks) do
    not change the grouping; kept for the caller."""
    del units
    norms: list[nn.Module] = [n for n in model.modules() if isinstance(n, nn.modules.batchnorm._BatchNorm)]
    return [norms] if norms else []


# How --fsdp-shard lays the processes out when the job spans more than one node.
def mesh_shape(shard_over: str, world: int, local_world: int) -> tuple[int, int] | None:
    """(replicas, shards) for HSDP, or None for one flat group of `world` shards.

    `node` (the default) shards within a node and replicates across nodes (HSDP): every all-gather and
    reduce-scatter of the forward and backward stays on the node's NVLink, and only the gradient shards cross the
    slower inter-node network: FSDP2 all-reduces them over the replicate dimension once per FSDP unit and step
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: the all_reduce on
    all_reduce_group after each unit's reduce-scatter), one per block, one for the norm layers, one for the root. Flat FSDP over several nodes sends every
    block's all-gather across it, twice (forward, and again in backward after resharding). `all` shards over
    every process: 1/world of the state per GPU, for a model too big for one node. One node (or one process per
    node, where a replica would hold everything) keeps the flat layout."""
    if shard_over == "all" or local_world <= 1 or world <= local_world or world % local_world:
        return None
    return world // local_world, local_world


def agreed_local_world(sizes: list[int]) -> int:
    """The processes per node every rank lays the mesh out by, from every rank's LOCAL_WORLD_SIZE: theirs when
    all nodes agree, else 1 (flat FSDP). Each rank deciding from its own count would split the ranks into flat
    and HSDP layouts (an 8-GPU node and a 4-GPU node: 12 % 8 flat, 12 / 4 HSDP), each waiting in
    init_device_mesh for groups the others never form."""
    return sizes[0] if len(set(sizes)) == 1 else 1


def local_world_sizes(ctx: DistContext) -> list[int]:
    """Every rank's LOCAL_WORLD_SIZE, by rank (one all_gather, once at start)."""
    mine = torch.tensor([ctx.local_world_size], dtype=torch.int64, device=ctx.device)
    every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    tdist.all_gather(every, mine)
    return [int(t) for t in every]


def device_mesh(cfg: Config, ctx: DistContext) -> DeviceMesh | None:
    sizes = local_world_sizes(ctx)
    local_world = agreed_local_world(sizes)
    if local_world != ctx.local_world_size:
        log.warning("fsdp: nodes with different process counts (%s): flat FSDP over all %d processes, no HSDP",
                    ",".join(map(str, sorted(set(sizes)))), ctx.world_size)
    shape = mesh_shape(cfg.fsdp_shard, ctx.world_size, local_world)
    if shape is None:
        return None
    log.info("fsdp: %d nodes x %d processes: sharded within a node, replicated across nodes (HSDP)", *shape)
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=("replicate", "shard"))


def shard(cfg: Config, ctx: DistContext, model: nn.Module) -> nn.Module:
    """fully_shard the BatchNorm layers as one group (fp32, norm_policy), every block (see the module docstring for
    reshard_after_forward), then the root. Call on every rank with the same (seeded) weights: each keeps its
    own slice of each parameter."""
    from torch.distributed.fsdp import fully_shard
    name = precision.resolve(cfg.precision, ctx.device)
    policy, mesh = mp_policy(name), device_mesh(cfg, ctx)
    units = shard_units(model)
    for group in batch_norm_groups(model, units):
        # Not resharded after forward: the norms are a few KiB, not worth a second all-gather in backward.
        fully_shard(group, mesh=mesh, mp_policy=norm_policy(name), reshard_after_forward=False)
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def grad_scaler(cfg: Config, device: torch.device, sharded: bool = False) -> torch.amp.GradScaler:
    """`sharded`: the gradients are FSDP's shards (the FSDP strategy says so). fp16 under FSDP with a process
    group: ShardedGradScaler (found_inf agreed across ranks); otherwise precision's own. One process without a group (a 1-GPU node, `python -m trainer` alone) has an unsharded model
    (state.build): ShardedGradScaler.unscale_ would all-reduce found_inf over the default group, which does not
    exist (`Default process group has not been initialized` at the first step); the plain scaler sees every
    gradient already. A group of one rank (the GPU tier's NCCL group) keeps the sharded scaler: its all-reduce
    is a real one-rank collective."""
    name = precision.resolve(cfg.precision, device)
    if sharded and tdist.is_available() and tdist.is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type, enabled=precision.precision_plan(name).scaler_enabled)
    return precision.grad_scaler(device, name)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This process's own part of a tensor: an FSDP DTensor's local shard, a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(tensors: Any) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Memory:
    """Bytes this process holds for training state (not activations)."""

    params: int
    grads: int
    optimizer: int

    def describe(self) -> str:
        mib = 2**20
        return (f"params {self.params / mib:.2f} MiB, grads {self.grads / mib:.2f} MiB, "
                f"optimizer {self.optimizer / mib:.2f} MiB per process")


def memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Memory:
    """What is allocated now: grads and optimizer state exist after the first step."""
    params = list(model.parameters())
    state = [v for per_param in optimizer.state.values() for v in per_param.values()]
    return Memory(_nbytes(params), _nbytes(p.grad for p in params), _nbytes(state))


def expected_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Memory:
    """What the first step will hold: one fp32 gradient per parameter shard, and SGD's momentum buffer (one
    per parameter shard) when momentum is on; before any step, for the start-up log line."""
    params = _nbytes(model.parameters())
    slots = sum(1 for g in optimizer.param_groups if g.get("momentum", 0) > 0) / max(1, len(optimizer.param_groups))
    return Memory(params, params, int(params * slots))

