"""--pp N: the model cut into stages (trainer/pipeline.py), run by a schedule of torch.distributed.pipelining.

The processes form a (pp x dp) mesh, pp outermost (ranks r*dp .. r*dp+dp-1 hold stage r), so the data-parallel
collectives stay among neighbouring ranks (one node) and only activations cross nodes. Inside a stage, DDP or
FSDP2 over the dp group as --strategy says (FSDP not resharded after forward: each micro-batch's backward would
all-gather again; torchtitan does the same). The loss lives on the last stage and is sent to the pipeline's other
ranks each step, so the loop's progress line, epoch mean and divergence check see it on rank 0 as before.
Checkpoints are DCP folders keyed by the full model's parameter names: they load at any pp, under DDP or FSDP.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel

from .. import device, models, optim, parallel, pipeline, snapshot
from ..config import Config, pp_microbatches, pp_split_counts, pp_stages
from ..data import Split, normalize
from ..dist import DistContext
from ..errors import ConfigError, StagesDoNotFit
from ..precision import autocast, resolve
from ..state import Position, TrainState
from ..strategy import Strategy

log = logging.getLogger(__name__)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each micro-batch's mean loss; the schedule divides the gradients by the micro-batches (scale_grads), so
    they are the whole batch's mean, as without pipelining."""
    return F.cross_entropy(out.float(), y)


@contextmanager
def _timing(parts: list[pipeline.Part], forward: Callable[[], AbstractContextManager[None]]) -> Iterator[None]:
    """`forward` (the rank's timer) entered around each of the stages' own forwards, one per micro-batch, not
    around the schedule's step: that also waits for the neighbour stages' activations and gradients, so every
    rank's would be the slowest stage's, and the per-rank view could not tell which stage holds the others back."""
    open_timers: list[AbstractContextManager[None]] = []

    def before(module: nn.Module, args: Any) -> None:
        open_timers.append(forward())
        open_timers[-1].__enter__()

    def after(module: nn.Module, args: Any, out: Any) -> None:
        open_timers.pop().__exit__(None, None, None)

    handles = [h for part in parts for h in (part.register_forward_pre_hook(before), part.register_forward_hook(after))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PipelineStrategy(Strategy):
    sharded_checkpoints = True

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.pp, self.microbatches, self.stages = cfg.pp, pp_microbatches(cfg), pp_stages(cfg)
        self.dp, self.pp_rank, self.dp_rank = 1, 0, 0
        self.split: list[int] = []
        self.costs: pipeline.StageCosts | None = None
        self.schedule: Any = None
        self.pp_group: tdist.ProcessGroup | None = None
        self.has_first = self.has_last = False
        self.parts: list[pipeline.Part] = []  # this process's stages, unwrapped: their forwards are its own work

    def data_share(self, ctx: DistContext) -> tuple[int, int]:
        return self.dp_rank, self.dp

    def check_batch(self, ctx: DistContext, per_process: int) -> None:
        """--keep-global-batch on another world size: the replica's batch grows or shrinks and the schedule's
        micro-batches are the accumulation (no loop of its own), so they must still divide it."""
        replica = per_process * ctx.world_size // self.dp
        if replica % self.microbatches:
            raise ConfigError(f"--keep-global-batch: each of the {self.dp} replicas would take {replica} images per "
                              f"step, not divisible by --pp-microbatches {self.microbatches}; resume with a process "
                              "count or --pp-microbatches that divides it")

    def rank_stages(self, ctx: DistContext) -> tuple[int, ...] | None:
        return tuple(rank // self.dp for rank in range(ctx.world_size))

    def describe(self) -> str:
        costs = "not measured"
        if self.costs is not None:
            seconds, moved = (self.costs.per_stage(self.split, of) for of in (self.costs.seconds, self.costs.transfer_s))
            costs = (" ".join(f"{c * 1000:.1f}" for c in seconds) + " ms, of which transfers "
                     + " ".join(f"{c * 1000:.1f}" for c in moved) + " ms")
            if self.costs.limit_bytes is not None:
                costs += (", memory " + " ".join(f"{b / 2**30:.2f}" for b in self.costs.per_stage(
                    self.split, self.costs.bytes)) + f" GiB of {self.costs.limit_bytes / 2**30:.2f}")
        return (f"pipeline: {self.stages} stages x {self.dp} replicas ({self.cfg.pp_schedule}, "
                f"{self.microbatches} micro-batches), split {self.split} blocks ({self.cfg.pp_split}), "
                f"stage costs {costs}, bubble {pipeline.bubble(self.pp, self.microbatches):.1%}")

    # ---- build ------------------------------------------------------------------------------------------------

    def _mesh(self, ctx: DistContext) -> DeviceMesh:
        if ctx.world_size % self.pp:
            raise ConfigError(f"--pp {self.pp} does not divide the {ctx.world_size} processes; use a process count "
                              f"that is a multiple of {self.pp}")
        self.dp = ctx.world_size // self.pp
        self.pp_rank, self.dp_rank = divmod(ctx.rank, self.dp)
        return init_device_mesh(ctx.device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))

    def _decide_split(self, ctx: DistContext, model: nn.Module) -> None:
        """Rank 0 decides (measuring with auto) and every rank takes its decision, or its refusal."""
        blocks = len(pipeline.blocks_of(model))
        links = pipeline.measure_links(ctx, self.pp, self.dp, self.stages, self.pp_group) if self.cfg.pp_split == "auto" else []
        decision: list[Any] = [None, None, None]
        if ctx.is_main:
            explicit = pp_split_counts(self.cfg)
            if explicit is not None:
                decision = [explicit, None, None]
            elif self.cfg.pp_split == "uniform":
                decision = [pipeline.uniform_split(blocks, self.stages), None, None]
            else:
                costs = self._costs(ctx, model, links)
                try:
                    decision = [pipeline.balanced_split(costs, self.stages), costs, None]
                except StagesDoNotFit as e:
                    decision = [None, None, (e.need, e.limit, e.stages)]
        if ctx.distributed:
            tdist.broadcast_object_list(decision, src=0, device=ctx.device)
        if decision[2] is not None:
            raise StagesDoNotFit(*decision[2])
        self.split, self.costs = decision[0], decision[1]

    def _costs(self, ctx: DistContext, model: nn.Module, links: list[float]) -> pipeline.StageCosts:
        """What the split weighs on this job's device, at its micro-batch size (rank 0's figures stand for every
        rank's: the processes of a job run on alike devices)."""
        micro = self.cfg.batch_size * self.pp // self.microbatches
        measured = pipeline.profile(model, micro, ctx.device)
        per_param = 2 + (1 if self.cfg.momentum > 0 else 0)  # the weights, their gradients, SGD's momentum
        return pipeline.StageCosts(
            measured.seconds, measured.out_bytes, links, [b * per_param for b in measured.param_bytes],
            measured.saved_bytes, pipeline.in_flight(self.cfg.pp_schedule, self.stages, self.microbatches),
            self._stage_memory(ctx))

    def _stage_memory(self, ctx: DistContext) -> float | None:
        """What one stage may use on a GPU: the device's free memory plus what this process's allocator holds
        (the whole model now, the stage's own part later), shared by the process's stages (interleaved: 2). None
        on a CPU: no limit there (the host's memory is the operating system's to share)."""
        if ctx.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(ctx.device)
        return (free + torch.cuda.memory_reserved(ctx.device)) / (self.stages // self.pp)

    def build(self, cfg: Config, ctx: DistContext) -> TrainState:
        mesh = self._mesh(ctx)
        self.pp_group = mesh.get_group("pp")
        model = device.place(models.for_run(cfg), ctx.device)
        self._decide_split(ctx, model)
        if ctx.is_main:
            log.info("%s", self.describe())
        ids = [self.pp_rank + k * self.pp for k in range(self.stages // self.pp)]
        parts = self.parts = pipeline.cut(model, self.split, ids)
        wrapped = [self._inside_stage(cfg, ctx, mesh["dp"], part) for part in parts]
        held = pipeline.merged(parts)  # after sharding: FSDP's parameters, under the full model's names
        self.has_first, self.has_last = 0 in ids, self.stages - 1 in ids
        stages = [PipelineStage(w, i, self.stages, ctx.device, group=self.pp_group) for w, i in zip(wrapped, ids,
                                                                                                      strict=True)]
        self.schedule = self._schedule(stages)
        inside_fsdp = cfg.strategy == "fsdp"  # the optimizer and scaler FSDP's would take (at dp 1 too, as before)
        optimizer = optim.build(cfg, held.parameters(), inside_fsdp)
        return TrainState(held, held, optimizer, parallel.grad_scaler(cfg, ctx.device, inside_fsdp), Position())

    def _inside_stage(self, cfg: Config, ctx: DistContext, dp_mesh: DeviceMesh, part: pipeline.Part) -> nn.Module:
        """DDP or FSDP2 over the stage's dp group (nothing with one replica)."""
        if self.dp == 1:
            return part
        if cfg.strategy == "fsdp":  # the job's MixedPrecisionPolicy, as parallel.shard (no BatchNorm here)
            policy = parallel.mp_policy(resolve(cfg.precision, ctx.device))
            for block in getattr(part, part.kind.blocks):
                fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
            fully_shard(part, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
            return part
        # find_unused_parameters: every parameter is used, but with it DDP does not rebuild its buckets from the
        # first step's gradient order, which a schedule with two backwards in a row before the step ends (GPipe,
        # interleaved, 1F1B with 2 micro-batches) recorded twice: the second step failed in reducer.cpp's rebuild
        # ("36 versus rebuilt params size of: 72"). static_graph=True avoids that too but averaged the first step's
        # gradients wrongly under the schedules' no_sync (the numerics test's grad_err 0.44). The cost is a walk of
        # the stage's autograd graph per micro-batch's forward.
        return DistributedDataParallel(part, process_group=dp_mesh.get_group(), find_unused_parameters=True,
                                       **parallel.ddp_kwargs(ctx.device))

    def _schedule(self, stages: list[Any]) -> Any:
        if self.cfg.pp_schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, self.microbatches, loss_fn=_loss)
        kind = Schedule1F1B if self.cfg.pp_schedule == "1f1b" else ScheduleGPipe
        return kind(stages[0], self.microbatches, loss_fn=_loss)

    def wrap(self, cfg: Config, ctx: DistContext, st: TrainState) -> None:
        """Wrapped in build: DDP's constructor ran before the restore, which then loaded every replica alike."""

    def restore(self, cfg: Config, ctx: DistContext, st: TrainState) -> int:
        names = [n for n, _ in models.build(cfg.model).named_parameters()]  # a DDP .pt's optimizer order
        return snapshot.restore(cfg, ctx, st, names)

    # ---- step and evaluation ----------------------------------------------------------------------------------

    def _run(self, x: torch.Tensor, y: torch.Tensor, losses: list[torch.Tensor] | None, train: bool,
             precision: str) -> Any:
        args = (x,) if self.has_first else ()
        with autocast(x.device, precision):
            if train:
                return self.schedule.step(*args, target=y, losses=losses)
            return self.schedule.eval(*args, target=y)

    def train_step(self, st: TrainState, x: torch.Tensor, y: torch.Tensor, lr: float, precision: str, micro: int,
                   forward: Callable[[], AbstractContextManager[None]]) -> torch.Tensor:
        """`micro` (gradient accumulation) is not needed: the schedule's micro-batches already split the batch."""
        for group in st.optimizer.param_groups:
            group["lr"] = lr
        st.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with _timing(self.parts, forward):
            self._run(x, y, losses, True, precision)
        loss = torch.stack([v.detach() for v in losses]).mean() if self.has_last else torch.zeros((), device=x.device)
        tdist.broadcast(loss, group=self.pp_group, group_src=self.pp - 1)  # the last stage's process
        st.scaler.step(st.optimizer)
        st.scaler.update()
        return loss

    @torch.no_grad()
    def evaluate(self, st: TrainState, test: Split, ctx: DistContext, precision: str, batch: int) -> float:
        """Through the schedule's eval, in batches of the training step's size (the stages' buffers have its
        shapes; --eval-batch-size does not apply). Replica r takes samples r, r+dp, ...; every replica runs as
        many batches as the largest (padded with image 0, not counted): FSDP's all-gathers need every rank."""
        size = self.cfg.batch_size * self.pp
        idx = torch.arange(self.dp_rank, len(test), self.dp, device=test.images.device)
        rounds = math.ceil(math.ceil(len(test) / self.dp) / size)
        counts = torch.zeros(2, dtype=torch.float64, device=test.images.device)
        st.model.eval()
        for k in range(rounds):
            part = idx[k * size:(k + 1) * size]
            rows = torch.cat([part, part.new_zeros(size - len(part))])
            out = self._run(normalize(test.images[rows]), test.labels[rows], None, False, precision)
            if self.has_last and len(part):
                counts[0] += (out[:len(part)].argmax(dim=1) == test.labels[part]).sum()
                counts[1] += len(part)
        st.model.train()
        if ctx.distributed:
            tdist.all_reduce(counts)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0
