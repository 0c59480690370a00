"""Host-device synchronisations per training step and per epoch loop, counted on the CPU (unit, in process).

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
from kit.trainer_helpers import base_args
from torch.overrides import TorchFunctionMode

from orchestrate.watch.health import RankStack
from trainer import data, defaults, dist, loop, metrics, state, strategies
from trainer.__main__ import main
from trainer.config import Config
from trainer.contract import PEER_WAIT_FUNCTION
from trainer.dist import DistContext
from trainer.pace import AGREE_EVERY, Cadence, LoopState, StopRequest, agreement_interval

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


def count_epoch_syncs(monkeypatch: pytest.MonkeyPatch, heartbeat_s: float) -> list[list[str]]:
    """The syncs of each epoch's whole loop (loop._train_epoch: batches, steps, the log line's and the heartbeat's
    reads, the agreement, the epoch's sums), without the evaluation and checkpoint after it; a beat every
    heartbeat_s seconds."""
    counts: list[list[str]] = []
    real_epoch = loop._train_epoch

    def counted_epoch(*a: Any, **k: Any) -> loop.EpochStats:
        with SyncCounter() as c:
            out = real_epoch(*a, **k)
        counts.append(c.calls)
        return out

    monkeypatch.setattr(loop, "_train_epoch", counted_epoch)
    monkeypatch.setattr(metrics, "HEARTBEAT_S", heartbeat_s)
    return counts


@pytest.fixture
def per_epoch(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The syncs of each epoch's loop, with no beat due."""
    return count_epoch_syncs(monkeypatch, 1e9)


def test_an_epochs_loop_syncs_only_to_agree_and_to_sum_the_epoch(per_epoch: list[list[str]], data_dir: Path,
                                                                 tmp_path: Path, inprocess: None) -> None:
    """16 steps per epoch, 2 epochs: the agreement every AGREE_EVERY steps reads its flags, and the epoch reads a
    few things once (its permutation's move, its loss sum); a read per step (the loss for a log line that is not
    printed, or for a heartbeat that is not due) would add 16. Seen on 2026-11-25: 5 in each epoch (`to`, `tolist`
    twice, `__bool__`, `__float__`); before the GPU defaults (merge 1a5c707), the first epoch had 4 more (the first step's
    per-device constants), which the first epoch's bound still allows."""
    args = base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "32", "--log-every", "1000")
    assert main(args) == 0
    print("syncs of each epoch's loop:", per_epoch)
    agreements = 16 // AGREE_EVERY
    assert len(per_epoch) == 2
    assert len(per_epoch[1]) <= agreements + 3, per_epoch
    assert len(per_epoch[0]) <= agreements + 3 + 4, per_epoch


def test_a_heartbeat_every_step_adds_no_host_sync(monkeypatch: pytest.MonkeyPatch, data_dir: Path, tmp_path: Path,
                                                  inprocess: None) -> None:
    """A beat written after every step (HEARTBEAT_S 0) and no step record: the epoch's loop syncs as often as
    with no beat at all. Before the fix the beat read the loss itself (`.item()`: 16 more per epoch, seen)."""
    counts = count_epoch_syncs(monkeypatch, 0.0)
    assert main(base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "32", "--log-every", "1000")) == 0
    assert len(counts[1]) <= 16 // AGREE_EVERY + 3, counts


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
    assert dist.agree(ctx, torch.tensor(math.nan), True, False) == ((True, False), True, 0.0, [])
    assert RankStack(0, 0, dump.read_text()).in_collective
    assert f" in {PEER_WAIT_FUNCTION}\n" in dump.read_text()


@pytest.mark.parametrize(("rank", "reads"), [(0, 8), (1, 0)])
def test_only_global_rank_0_reads_the_loss_for_its_log_line(rank: int, reads: int, data_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One epoch of rank `rank` of 2 with a log line every step (the collectives stood in for by no-ops: the
    count is this rank's own): the loss is read (`.item()`, a host sync on a GPU) for rank 0's lines only;
    the other ranks' lines are not printed, and must not cost a sync either."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(metrics, "HEARTBEAT_S", 1e9)
    cfg = Config(data_dir=data_dir, ckpt_dir=tmp_path, model="tiny", log_every=1, allow_unverified_data=True)
    ctx = DistContext(rank, rank, 2, torch.device("cpu"))
    train, _ = data.load_cifar(data_dir, allow_unverified=True)
    loader = data.TrainLoader(train, 32, rank, 2, cfg.seed)  # 8 steps of global batch 64
    steps = metrics.StepLog(tmp_path, 64, None, None) if ctx.is_main else None  # as trainer/__main__.py has it
    pace = LoopState(metrics.Heartbeat(tmp_path, ctx.is_main, 8, 1, 64), defaults.resolve(cfg, "cpu", False, 64),
                     strategies.for_config(cfg), steps=steps)
    st = state.build(cfg, ctx)
    with SyncCounter() as c:
        loop._train_epoch(cfg, ctx, st, loader, StopRequest(), pace)
    assert c.calls.count("item") == reads


@pytest.mark.parametrize(("slowest_step_s", "every"), [(0.0, 1), (0.006, 8), (0.25, 8), (0.3, 4), (0.5, 4),
                                                       (0.9, 2), (1.2, 1), (4.0, 1)])
def test_the_agreement_interval_fits_the_slowest_ranks_steps_in_two_seconds(slowest_step_s: float,
                                                                             every: int) -> None:
    """A fast step agrees every 8 (one drain of the GPU queue per 8 steps); a slow one as often as a stop needs
    (torchrun's SIGKILL follows its SIGTERM by 30 s); 0 (nothing measured yet) every step."""
    assert agreement_interval(slowest_step_s) == every


def test_the_cadence_measures_from_its_second_window_and_leaves_pauses_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank sends its own window's seconds per step and takes the agreed (slowest) figure's interval; the
    process's first window (start-up) is not measured, a checkpoint's pause (restart) is not counted."""
    clock = [100.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    cadence = Cadence()
    assert cadence.every == 1 and cadence.due(1)
    clock[0] += 30.0  # step 1: start-up
    cadence.agreed(1, slowest_step_s=0.0)
    assert cadence.step_s == 0.0 and cadence.every == 1
    clock[0] += 3.0  # step 2
    cadence.agreed(2, slowest_step_s=0.0)
    assert cadence.step_s == 3.0
    clock[0] += 9.0  # a checkpoint's pause, then 2 steps of 0.1 s
    cadence.restart(2)
    clock[0] += 0.2
    cadence.agreed(4, slowest_step_s=0.1)
    assert cadence.step_s == pytest.approx(0.1) and cadence.every == 8
    assert [s for s in range(5, 17) if cadence.due(s)] == [8, 16]
