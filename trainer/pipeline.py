"""Pipeline parallelism's parts: the balanced split, the stages cut from the full model, the block timings.

- The split: contiguous runs of blocks, one per stage, the stem with the first and the head with the last.
  `balanced_split` minimises the slowest stage exactly (dynamic program over prefixes, O(blocks^2 x stages)),
  from each block's forward+backward time measured on the job's device at its micro-batch size (`block_costs`).
  torchgpipe's balance_by_time measures the same way; DeepSpeed's partition_balanced minimises the spread instead.
- The stages: `Part` holds the full model's attributes under their own names (the blocks as an nn.Sequential of
  the kept ones, under their original indices), so every parameter name is the full model's: DCP checkpoints
  merge the stages back into one model and load into any other layout (FIELD-NOTES: `del seq[i]` renumbers).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError
from .models import PIPELINED, Pipelined


def stage_cost(costs: Sequence[float], split: Sequence[int]) -> list[float]:
    """The summed cost of each stage's blocks."""
    out, at = [], 0
    for n in split:
        out.append(float(sum(costs[at:at + n])))
        at += n
    return out


def balanced_split(costs: Sequence[float], stages: int) -> list[int]:
    """Block counts per stage (contiguous, each >= 1) whose slowest stage is the least possible.

    best[k][i]: the least possible slowest stage when the first i blocks form k stages; the last of those stages
    is blocks j..i-1 for the j that minimises max(best[k-1][j], sum(j..i-1)). Ties keep the earliest cut."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


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
        return self.kind.run_head(self, x) if self.last else x


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


def block_costs(model: nn.Module, micro: int, device: torch.device, warmup: int = 2, reps: int = 5) -> list[float]:
    """Seconds of forward+backward for each block on a micro-batch of `micro` images, the stem's added to the
    first block and the head's (with the loss) to the last: what each stage will run per micro-batch."""
    kind, blocks = kind_of(model), blocks_of(model)
    x = torch.randn(micro, 3, 32, 32, device=device)
    y = torch.zeros(micro, dtype=torch.long, device=device)
    ends = Part(model, [], True, False), Part(model, [], False, True)
    costs, h = [], x

    def fwd_bwd(module: nn.Module, inp: torch.Tensor, loss: bool = False) -> None:
        out = module(inp.detach().requires_grad_(inp.is_floating_point()))
        (F.cross_entropy(out, y) if loss else out.float().square().mean()).backward()

    stem_s = _timed(lambda: fwd_bwd(ends[0], x), device, warmup, reps)
    with torch.no_grad():
        h = kind.run_stem(ends[0], x)
    for block in blocks:
        inp = h
        costs.append(_timed(lambda b=block, i=inp: fwd_bwd(b, i), device, warmup, reps))
        with torch.no_grad():
            h = block(inp)
    head_s = _timed(lambda: fwd_bwd(ends[1], h, loss=True), device, warmup, reps)
    model.zero_grad(set_to_none=True)
    costs[0] += stem_s
    costs[-1] += head_s
    return costs
