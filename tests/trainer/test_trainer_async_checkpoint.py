"""Asynchronous checkpoints (--ckpt-async on, the GPU default) and time-based evaluation, in-process runs of the
real trainer on CPU. The background write is held at a gate (an Event), never timed with a sleep: training
steps run while it is held, and the end of the run or a stop waits for it before its own, synchronous save."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from kit.trainer_helpers import base_args, metrics_lines, newest_state, run_torchrun

from trainer import checkpoint, dcp_checkpoint, loop
from trainer.__main__ import main
from trainer.contract import EXIT_STOPPED
from trainer.errors import CheckpointError

GATE_S = 60.0  # a bound on every wait of the gate; the run itself takes a few seconds


class HeldWrite:
    """checkpoint.save patched: a write from the writer's thread waits at the gate until the training thread
    enters BackgroundWriter.wait (the end, a stop, the next save); every event in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop_during_write: bool = False) -> None:
        self.events: list[str] = []
        self.release = threading.Event()
        self.stop_during_write = stop_during_write
        real_save, real_wait, real_step = checkpoint.save, checkpoint.BackgroundWriter.wait, loop.train_step

        def save(folder: Path, state: dict[str, Any], **kw: Any) -> Path:
            background = threading.current_thread() is not threading.main_thread()
            if background:
                self.events.append(f"write {kw['step']} starts")
                assert self.release.wait(GATE_S), "the training thread never waited for the background write"
            path = real_save(folder, state, **kw)
            self.events.append(f"{'background' if background else 'synchronous'} write {kw['step']} done")
            return path

        def wait(writer: checkpoint.BackgroundWriter, timeout_s: float) -> int | None:
            if writer.pending:
                self.events.append("training waits")
                self.release.set()
            return real_wait(writer, timeout_s)

        def step(st: Any, *a: Any, **k: Any) -> torch.Tensor:
            loss = real_step(st, *a, **k)
            if self.events and self.events[-1].endswith("starts") or self.events[-1:] == ["step"]:
                self.events.append("step")
                if self.stop_during_write:
                    os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler sets its flag
            return loss

        monkeypatch.setattr(checkpoint, "save", save)
        monkeypatch.setattr(checkpoint.BackgroundWriter, "wait", wait)
        monkeypatch.setattr(loop, "train_step", step)


def _args(data_dir: Path, ck: Path, *extra: str) -> list[str]:
    return base_args(data_dir, ck, "--batch-size", "64", "--ckpt-async", "on", "--keep-checkpoints", "5", *extra)


def test_training_goes_on_while_a_checkpoint_is_written_and_the_end_waits_for_it(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldWrite(monkeypatch)
    assert main(_args(data_dir, tmp_path, "--epochs", "2")) == 0  # 8 steps per epoch
    assert held.events == ["write 8 starts", *["step"] * 8, "training waits", "background write 8 done",
                           "synchronous write 16 done"]
    assert [info.step for info in [checkpoint.newest_valid(tmp_path)] if info] == [16]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.json")) == ["ckpt-00000008.json", "ckpt-00000016.json"]


def test_a_stop_during_a_background_write_waits_for_it_then_saves_its_own_step(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM right after the write of step 8 started: the ranks agree on the stop at step 16 (the next
    agreement), the stop's save waits for the pending write, then writes step 16 synchronously."""
    held = HeldWrite(monkeypatch, stop_during_write=True)
    assert main(_args(data_dir, tmp_path, "--epochs", "3")) == EXIT_STOPPED
    assert held.events == ["write 8 starts", *["step"] * 8, "training waits", "background write 8 done",
                           "synchronous write 16 done"]
    assert newest_state(tmp_path)["step"] == 16


@pytest.mark.parametrize(("epochs", "code", "said"), [
    (3, 2, "error: checkpoint dir"),  # the next save, in the background too, fails the run
    (2, 0, "WARNING checkpoint dir"),  # the end's own save is still tried, and works
])
def test_a_failed_background_write_fails_the_next_save_but_the_end_still_saves(
        epochs: int, code: int, said: str, data_dir: Path, tmp_path: Path, inprocess: None,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real_save = checkpoint.save

    def full_disk_in_background(folder: Path, state: dict[str, Any], **kw: Any) -> Path:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(f"checkpoint dir {folder} is full (test)")
        return real_save(folder, state, **kw)

    monkeypatch.setattr(checkpoint, "save", full_disk_in_background)
    assert main(_args(data_dir, tmp_path, "--epochs", str(epochs))) == code
    assert said in capsys.readouterr().err
    info = checkpoint.newest_valid(tmp_path)
    assert (info.step if info else None) == (16 if code == 0 else None)


def test_evaluation_by_time_at_an_epochs_end_and_always_after_the_last(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step "takes" a minute (8 per epoch); evaluations every 10 minutes: at the end of epoch 2 (16 min),
    not 3 (8 min after), and after the last epoch (4)."""
    clock = [0.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    real_step = loop.train_step

    def step_one_minute(*a: Any, **k: Any) -> torch.Tensor:
        clock[0] += 60.0
        return real_step(*a, **k)

    monkeypatch.setattr(loop, "train_step", step_one_minute)
    assert main(_args(data_dir, tmp_path, "--epochs", "4", "--ckpt-async", "off", "--eval-every", "100",
                      "--eval-every-minutes", "10")) == 0
    evaluated = [r["epoch"] for r in metrics_lines(tmp_path) if r.get("test_acc") is not None]
    assert evaluated == [2, 4]


def test_the_first_log_line_says_what_auto_became_and_why(data_dir: Path, tmp_path: Path, inprocess: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(base_args(data_dir, tmp_path, "--epochs", "1", "--batch-size", "64", "--max-steps", "1")) == 0
    first = next(line for line in capsys.readouterr().err.splitlines() if "INFO" in line)
    assert first.endswith("settings: precision fp32 (auto: CPU); lr 0.1 (--lr as given, auto: no scaling on "
                          "CPU), warmup 1 epochs (auto); checkpoints every 1 epochs synchronous (auto on CPU); "
                          "evaluation every 1 epochs, and after the last epoch (auto on CPU)"), first


@pytest.mark.slow
def test_fsdp_writes_its_shards_with_dcp_async_save_and_every_checkpoint_is_complete(data_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """2 processes, gloo, FSDP2: the epoch-1 save goes through DCP's async_save (its collectives on a gloo group
    of its own), completed at the end before the final, synchronous save; both folders are valid."""
    res = run_torchrun(2, _args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "32", "--strategy", "fsdp"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sharded checkpoint of step 8 copied off the device" in res.stderr
    assert [dcp_checkpoint._validate(tmp_path / f"ckpt-{step:08d}") is not None for step in (8, 16)] == [True, True]


def test_fsdp_seals_and_hashes_its_asynchronous_checkpoint_while_training_goes_on(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, FSDP, --ckpt-async on: the epoch-1 save's seal (trainer.pt, sha256 of every file, manifest,
    fsyncs, rename) waits at a gate until a training step has run after it started; the seal of the end's
    synchronous save runs on the training thread. Before the fix the seal ran at the next wait, on the training
    thread: the gate was never opened (seen: `no training step ran while the seal of step 8 was held`)."""
    events: list[str] = []
    release = threading.Event()
    real_seal, real_step = dcp_checkpoint._seal, loop.train_step

    def seal(folder: Path, tmp: Path, final: Path, *a: Any) -> None:
        background = threading.current_thread() is not threading.main_thread()
        events.append(f"{'background' if background else 'synchronous'} seal {final.name}")
        if background:
            assert release.wait(GATE_S), f"no training step ran while the seal of {final.name} was held"
        real_seal(folder, tmp, final, *a)

    def step(*a: Any, **k: Any) -> torch.Tensor:
        if events and events[-1].startswith("background seal"):
            events.append("step")
            release.set()
        return real_step(*a, **k)

    monkeypatch.setattr(dcp_checkpoint, "_seal", seal)
    monkeypatch.setattr(loop, "train_step", step)
    assert main(_args(data_dir, tmp_path, "--epochs", "2", "--strategy", "fsdp")) == 0
    assert events == ["background seal ckpt-00000008", "step", "synchronous seal ckpt-00000016"]
    assert [dcp_checkpoint._validate(tmp_path / f"ckpt-{s:08d}") is not None for s in (8, 16)] == [True, True]
