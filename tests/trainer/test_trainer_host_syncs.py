"""Host-device synchronisations per training step, counted on the CPU (unit, in process).

On a GPU each of these blocks the host until the device catches up, so the CPU can no longer queue the next
step's kernels ahead: a tensor made from Python values (a host-to-device copy), a read of a device value
(`.item()`, `.cpu()`, `.tolist()`, `bool()`/`float()` of a tensor), boolean-mask indexing (its size is
data-dependent) and a blocking `.to(device)` from the trainer's code. The CPU cannot show the waits
themselves (only `torch.cuda.set_sync_debug_mode` on a GPU can), but it can count the calls that cause them.
"""

from __future__ import annotations

import faulthandler
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from trainer_helpers import base_args

from orchestrate.watch.health import RankStack
from trainer import data, dist, loop, metrics
from trainer.__main__ import main
from trainer.contract import PEER_WAIT_FUNCTION
from trainer.dist import DistContext

_FROM_PYTHON = {torch.tensor, torch.as_tensor, torch.scalar_tensor}
_READS = {torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.nonzero, torch.masked_select}


def _is_mask(index: object) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncCounter(TorchFunctionMode):
    """Records every call that would make the host wait for a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in _FROM_PYTHON or func in _READS:
            self.calls.append(name)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_mask(args[1]):
            self.calls.append(f"{name}[mask]")
        elif func is torch.Tensor.to and not kwargs.get("non_blocking") and _called_from_trainer():
            self.calls.append("to")
        return func(*args, **kwargs)


def _called_from_trainer() -> bool:
    """A `.to` in torch's own code moves what torch already placed (the fused optimizer's same-device no-op)."""
    frame = sys._getframe(2)
    return "/trainer/" in frame.f_code.co_filename.replace("\\", "/")


@pytest.fixture
def per_step(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The syncs of each training step: making its batch (data path) and the step itself (forward, backward,
    scaler, optimizer). The heartbeat's read is held off (one every HEARTBEAT_S seconds, asserted apart)."""
    counts: list[list[str]] = []
    real_step, real_batches = loop.train_step, data.TrainLoader.batches

    def counted_batches(self: data.TrainLoader, *a: Any, **k: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        it = real_batches(self, *a, **k)
        while True:
            with SyncCounter() as c:
                item = next(it, None)
            if item is None:
                return
            counts.append(c.calls)
            yield item

    def counted_step(*a: Any, **k: Any) -> torch.Tensor:
        with SyncCounter() as c:
            out = real_step(*a, **k)
        counts[-1].extend(c.calls)
        return out

    monkeypatch.setattr(data.TrainLoader, "batches", counted_batches)
    monkeypatch.setattr(loop, "train_step", counted_step)
    monkeypatch.setattr(metrics, "HEARTBEAT_S", 1e9)
    return counts


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_no_host_sync_in_a_training_step(precision: str, per_step: list[list[str]], data_dir: Path,
                                         tmp_path: Path, inprocess: None) -> None:
    """fp16: GradScaler.step reads found_inf with .item() each step unless the optimizer applies the scale
    itself (`_step_supports_amp_scaling`: SGD(fused=True)); the CPU runs the same fused path as CUDA."""
    args = base_args(data_dir, tmp_path, "--epochs", "1", "--batch-size", "64", "--log-every", "1000",
                     "--precision", precision)
    assert main(args) == 0
    assert len(per_step) == 8
    # The first step may make the per-device constants once; after it, none at all.
    assert [calls for calls in per_step[1:] if calls] == []


def test_the_agreement_waits_in_the_function_the_stall_report_names(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A real faulthandler dump (what SIGUSR1 writes) taken while the agreement's collective runs: the frame the
    orchestrator's stall report looks for (contract.PEER_WAIT_FUNCTION) is on the stack."""
    dump = tmp_path / "stack.txt"

    def all_reduce_then_dump(t: torch.Tensor, op: object = None) -> None:
        with dump.open("w") as f:
            faulthandler.dump_traceback(f, all_threads=False)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce_then_dump)
    ctx = DistContext(0, 0, 2, torch.device("cpu"))
    assert dist.agree(ctx, torch.tensor(math.nan), True, False) == ((True, False), True)
    assert RankStack(0, 0, dump.read_text()).in_collective
    assert f" in {PEER_WAIT_FUNCTION}\n" in dump.read_text()
