"""Pipeline parallelism's parts: the balanced split, the stages cut from the full model, the block timings.

- The split: contiguous runs of blocks, one per stage, the stem with the first and the head with the last.
  `balanced_split` minimises the slowest stage exactly (dynamic program over prefixes, O(blocks^2 x stages)),
  a stage's cost being its blocks' forward+backward time measured on the job's device at its micro-batch size
  (`profile`) plus the transfers at its cuts (each cut's activation forward and gradient back, over the link
  `measure_links` timed between the neighbouring stages' processes), among the splits whose every stage fits the
  device's memory (`StageCosts`). torchgpipe's balance_by_time measures compute the same way (no transfers, no
  memory); DeepSpeed's partition_balanced minimises the spread instead.
- The stages: `Part` holds the full model's attributes under their own names (the blocks as an nn.Sequential of
  the kept ones, under their original indices), so every parameter name is the full model's: DCP checkpoints
  merge the stages back into one model and load into any other layout (FIELD-NOTES: `del seq[i]` renumbers).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from .dist import DistContext
from .errors import ConfigError, StagesDoNotFit
from .models import PIPELINED, Pipelined


@dataclass(frozen=True)
class StageCosts:
    """What the split weighs, per block at the job's micro-batch size; a stage of blocks j..i-1 costs their compute
    plus the transfers at its cuts, and needs their memory.

    - compute_s: each block's forward+backward seconds (the stem's added to the first block, the head's and the
      loss's to the last).
    - out_bytes: each block's output activation. A cut after block k sends it forward and receives its gradient
      (as large) back, per micro-batch: both stages at the cut spend 2 x out_bytes[k] / link on it.
    - link_bps: the bytes per second of the link between stage s and s+1 (stages-1 entries); empty: free transfers.
    - state_bytes: each block's parameters, gradients and optimizer state, held whatever the micro-batches.
    - saved_bytes: what each block's forward keeps for its backward, per micro-batch.
    - in_flight: per stage, the most micro-batches whose activations it holds at once (the schedule says).
    - limit_bytes: what one stage may need on its device; None: no limit (a CPU)."""

    compute_s: Sequence[float]
    out_bytes: Sequence[float] = ()
    link_bps: Sequence[float] = ()
    state_bytes: Sequence[float] = ()
    saved_bytes: Sequence[float] = ()
    in_flight: Sequence[int] = ()
    limit_bytes: float | None = None

    def transfer_s(self, stage: int, start: int, end: int) -> float:
        """Stage `stage`'s share of the transfers at its two cuts (before block `start`, after block end-1)."""
        if not self.link_bps:
            return 0.0
        before = 2 * self.out_bytes[start - 1] / self.link_bps[stage - 1] if stage > 0 else 0.0
        after = 2 * self.out_bytes[end - 1] / self.link_bps[stage] if stage < len(self.link_bps) else 0.0
        return before + after

    def seconds(self, stage: int, start: int, end: int) -> float:
        return float(sum(self.compute_s[start:end])) + self.transfer_s(stage, start, end)

    def bytes(self, stage: int, start: int, end: int) -> float:
        if not self.state_bytes:
            return 0.0
        held = self.in_flight[stage] * sum(self.saved_bytes[start:end])
        return float(sum(self.state_bytes[start:end]) + held)

    def per_stage(self, split: Sequence[int], of: Callable[[int, int, int], float]) -> list[float]:
        """`of` (seconds, bytes or transfer_s) for each stage of `split`."""
        return [of(s, run[0], run[-1] + 1) for s, run in enumerate(stage_blocks(split))]


def stage_cost(costs: Sequence[float], split: Sequence[int]) -> list[float]:
    """The summed compute of each stage's blocks (no transfers)."""
    return StageCosts(costs).per_stage(split, StageCosts(costs).seconds)


def _least_largest(blocks: int, stages: int, cost: Callable[[int, int, int], float]) -> tuple[float, list[int]]:
    """The contiguous split (block counts, each >= 1) whose largest `cost(stage, start, end)` is the least possible,
    and that value. best[k][i]: the least largest cost when the first i blocks form k stages; the last of those is
    blocks j..i-1 for the j that minimises max(best[k-1][j], cost(k-1, j, i)). Ties keep the earliest cut. Exact,
    since a stage's cost depends only on its own index and blocks (its cut transfers included)."""
    inf = float("inf")
    best = [[inf] * (blocks + 1) for _ in range(stages + 1)]
    cut = [[0] * (blocks + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, blocks - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], blocks
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return best[stages][blocks], counts[::-1]


def balanced_split(costs: StageCosts | Sequence[float], stages: int) -> list[int]:
    """Block counts per stage (contiguous, each >= 1) whose slowest stage (compute + transfers at its cuts) is the
    least possible among the splits whose every stage fits `limit_bytes`. StagesDoNotFit when none does."""
    model = costs if isinstance(costs, StageCosts) else StageCosts(costs)
    n = len(model.compute_s)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} non-empty stages")
    limit = model.limit_bytes
    if limit is None:
        return _least_largest(n, stages, model.seconds)[1]
    need, _ = _least_largest(n, stages, model.bytes)
    if need > limit:
        raise StagesDoNotFit(need, limit, stages)
    inf = float("inf")
    return _least_largest(n, stages, lambda s, j, i: model.seconds(s, j, i) if model.bytes(s, j, i) <= limit else inf)[1]


def in_flight(schedule: str, stages: int, microbatches: int) -> list[int]:
    """The most micro-batches whose activations each stage holds at once: GPipe all m until the backwards start;
    1F1B stage s its p-s of warm-up (torch's Schedule1F1B), at most m; interleaved bounded by m (its warm-up
    depends on the rounds; the bound keeps the check on the safe side)."""
    if schedule == "1f1b":
        return [min(microbatches, stages - s) for s in range(stages)]
    return [microbatches] * stages


def uniform_split(blocks: int, stages: int) -> list[int]:
    """Equal block counts, the earlier stages one more where they do not divide (they also hold the stem)."""
    base, extra = divmod(blocks, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def bubble(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe or 1F1B step with equal stages: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def kind_of(model: nn.Module) -> Pipelined:
    kind = PIPELINED.get(type(model))
    if kind is None:
        raise ConfigError(f"--pp cannot split a {type(model).__name__}")
    return kind


def blocks_of(model: nn.Module) -> nn.Sequential:
    blocks = getattr(model, kind_of(model).blocks)
    assert isinstance(blocks, nn.Sequential)
    return blocks


class Part(nn.Module):
    """Some of a model's blocks, with the stem (`first`) and the head (`last`), under the full model's names.

    A pipeline stage is a Part of contiguous blocks; a process's Part of all its stages' blocks (interleaved: two
    runs) is what its optimizer and checkpoints see. The modules are the full model's own (shared, not copied)."""

    def __init__(self, model: nn.Module, blocks: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.kind, self.first, self.last = kind_of(model), first, last
        for name in (self.kind.stem if first else ()) + (self.kind.head if last else ()):
            _share(self, name, getattr(model, name))
        every = blocks_of(model)
        self.add_module(self.kind.blocks, nn.Sequential(OrderedDict((str(i), every[i]) for i in blocks)))

    def forward(self, x: torch.Tensor) -> Any:
        if self.first:
            x = self.kind.run_stem(self, x)
        x = getattr(self, self.kind.blocks)(x)
        # Not the last stage: the schedule sends x on, and gloo's and NCCL's send/recv take contiguous tensors
        # only (the receiver's buffer has x's strides). ViT's tokens are a transposed view of the patches.
        return self.kind.run_head(self, x) if self.last else x.contiguous()


def _share(holder: nn.Module, name: str, value: Any) -> None:
    if isinstance(value, nn.Parameter):
        holder.register_parameter(name, value)
    else:
        holder.add_module(name, value)


def stage_blocks(split: Sequence[int]) -> list[list[int]]:
    """The block indices of each stage."""
    out, at = [], 0
    for n in split:
        out.append(list(range(at, at + n)))
        at += n
    return out


def cut(model: nn.Module, split: Sequence[int], stage_ids: Sequence[int]) -> list[Part]:
    """The Parts of the stages `stage_ids` of `split`."""
    runs = stage_blocks(split)
    return [Part(model, runs[s], s == 0, s == len(split) - 1) for s in stage_ids]


def merged(parts: Sequence[Part]) -> Part:
    """One Part holding every module of `parts` under the full model's names (built after any wrapping, from the
    parts' attributes as they are then: FSDP registers its sharded parameters in place of the plain ones)."""
    first, last = parts[0], parts[-1]
    holder = Part.__new__(Part)
    nn.Module.__init__(holder)
    holder.kind, holder.first, holder.last = first.kind, first.first, last.last
    for part in parts:
        for name in (part.kind.stem if part.first else ()) + (part.kind.head if part.last else ()):
            _share(holder, name, getattr(part, name))
    kept = OrderedDict((i, b) for part in parts for i, b in getattr(part, part.kind.blocks).named_children())
    holder.add_module(first.kind.blocks, nn.Sequential(kept))
    return holder


# A ping-pong's size to measure a link by: between resnet20-gn's cuts (0.25-0.5 MiB at a micro-batch of 8) and
# resnet18-gn's at a GPU's micro-batch (16 MiB at 64), large enough that gloo's per-message cost on one host does
# not dominate; the figure is used as bytes per second for every cut's size.
LINK_PROBE_BYTES = 1 << 20


def _ping_pong(ctx: DistContext, a: int, b: int, group: tdist.ProcessGroup | None) -> float:
    """Bytes per second one way between global ranks a and b (this rank is one of them)."""
    buf = torch.zeros(LINK_PROBE_BYTES // 4, dtype=torch.float32, device=ctx.device)
    peer = b if ctx.rank == a else a
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        if ctx.rank == a:
            tdist.send(buf, peer, group=group)
            tdist.recv(buf, peer, group=group)
        else:
            tdist.recv(buf, peer, group=group)
            tdist.send(buf, peer, group=group)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i:  # the first one connects
            times.append(time.perf_counter() - t0)
    return LINK_PROBE_BYTES / (statistics.median(times) / 2)


def measure_links(ctx: DistContext, pp: int, dp: int, stages: int, group: tdist.ProcessGroup | None) -> list[float]:
    """Bytes per second between the processes of each two neighbouring stages (stage s runs on process s mod
    pp; process r is global rank r x dp), measured on the first replica's pipeline by a ping-pong of
    LINK_PROBE_BYTES, median of 5 after a warm-up: whatever the link is (loopback, NVLink, the network between
    nodes). Every pair is measured in one order by both its processes (no two wait on each other); every rank
    then takes every figure (a MAX all-reduce: each pair's figure comes from its own two processes). Collective:
    every rank calls it."""
    if not ctx.distributed:
        return [float("inf")] * (stages - 1)

    def pair(s: int) -> tuple[int, int]:
        a, b = sorted((s % pp, (s + 1) % pp))
        return a, b

    pairs = list(dict.fromkeys(pair(s) for s in range(stages - 1)))
    found = torch.zeros(len(pairs), dtype=torch.float64, device=ctx.device)
    for q, (a, b) in enumerate(pairs):
        if ctx.rank in (a * dp, b * dp):
            found[q] = _ping_pong(ctx, a * dp, b * dp, group)
    tdist.all_reduce(found, op=tdist.ReduceOp.MAX)
    bps = dict(zip(pairs, found.tolist(), strict=True))
    return [bps[pair(s)] for s in range(stages - 1)]


def _timed(fn: Any, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of `fn` after `warmup` untimed runs (the first ones allocate and pick kernels)."""
    times = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Profile:
    """Per block at one micro-batch (the stem's figures in the first block's, the head's and the loss's in the
    last's): forward+backward seconds, the output's bytes (what a cut after it sends), the bytes autograd keeps
    from its forward for its backward (parameters not counted) and its parameters' bytes."""

    seconds: list[float]
    out_bytes: list[int]
    saved_bytes: list[int]
    param_bytes: list[int]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _saved_bytes(fn: Any, params: nn.Module) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs a forward, the parameters' left out (they are
    the state's, held anyway)."""
    skip = {p.untyped_storage().data_ptr() for p in params.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def profile(model: nn.Module, micro: int, device: torch.device, warmup: int = 2, reps: int = 5) -> Profile:
    """Each block's figures on a micro-batch of `micro` images: what each stage will run per micro-batch."""
    kind, blocks = kind_of(model), blocks_of(model)
    x = torch.randn(micro, 3, 32, 32, device=device)
    y = torch.zeros(micro, dtype=torch.long, device=device)
    ends = Part(model, [], True, False), Part(model, [], False, True)

    def fwd_bwd(module: nn.Module, inp: torch.Tensor, loss: bool = False, backward: bool = True) -> None:
        """Forward and backward (a stand-in loss for the blocks before the head); without `backward`, the forward
        with the real loss only (what the stage keeps: no stand-in's saved output)."""
        out = module(inp.detach().requires_grad_(inp.is_floating_point()))
        if not (loss or backward):
            return
        value = F.cross_entropy(out, y) if loss else out.float().square().mean()
        if backward:
            value.backward()

    def param_bytes(module: nn.Module) -> int:
        return sum(_nbytes(p) for p in module.parameters())

    stem_s = _timed(lambda: fwd_bwd(ends[0], x), device, warmup, reps)
    stem_saved = _saved_bytes(lambda: fwd_bwd(ends[0], x, backward=False), ends[0])
    with torch.no_grad():
        h = kind.run_stem(ends[0], x)
    seconds, out_bytes, saved, params = [], [], [], []
    for block in blocks:
        inp = h
        seconds.append(_timed(lambda b=block, i=inp: fwd_bwd(b, i), device, warmup, reps))
        saved.append(_saved_bytes(lambda b=block, i=inp: fwd_bwd(b, i, backward=False), block))
        params.append(param_bytes(block))
        with torch.no_grad():
            h = block(inp)
        out_bytes.append(_nbytes(h))
    head_s = _timed(lambda: fwd_bwd(ends[1], h, loss=True), device, warmup, reps)
    head_saved = _saved_bytes(lambda: fwd_bwd(ends[1], h, loss=True, backward=False), ends[1])
    model.zero_grad(set_to_none=True)
    seconds[0] += stem_s
    seconds[-1] += head_s
    saved[0] += stem_saved
    saved[-1] += head_saved
    params[0] += param_bytes(ends[0])
    params[-1] += param_bytes(ends[1])
    return Profile(seconds, out_bytes, saved, params)
