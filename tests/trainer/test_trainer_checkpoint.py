"""Atomic checkpoints: newest valid, skipped damaged ones, pruning, random SIGKILLs mid-save, a full disk."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kit.disks import tmpfs

from trainer import checkpoint
from trainer.errors import CheckpointError


def _state(step: int, floats: int = 1000) -> dict:
    return {"step": step, "model": {"w": torch.full((floats,), float(step))}}


def _save(folder: Path, step: int, keep: int = 3, floats: int = 1000) -> Path:
    return checkpoint.save(folder, _state(step, floats), step=step, epoch=step // 10, epoch_complete=False,
                           world_size=2, keep=keep)


def test_save_writes_pt_and_manifest_per_design(tmp_path: Path) -> None:
    path = _save(tmp_path, 120)
    assert path.name == "ckpt-00000120.pt"
    m = json.loads((tmp_path / "ckpt-00000120.json").read_text())
    assert m["format"] == 1 and m["file"] == path.name and m["bytes"] == path.stat().st_size
    assert m["step"] == 120 and m["epoch"] == 12 and m["epoch_complete"] is False and m["world_size"] == 2
    assert len(m["sha256"]) == 64 and "created" in m
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_newest_valid_is_the_highest_step_and_loads(tmp_path: Path) -> None:
    for step in (5, 30, 12):
        _save(tmp_path, step, keep=5)
    info = checkpoint.newest_valid(tmp_path)
    assert info is not None and info.step == 30
    assert checkpoint.load(info, torch.device("cpu"))["step"] == 30


def test_keep_last_k_deletes_the_oldest(tmp_path: Path) -> None:
    for step in range(1, 7):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000005.json", "ckpt-00000005.pt", "ckpt-00000006.json", "ckpt-00000006.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "drop_manifest", "drop_pt"])
def test_damaged_newest_is_skipped_with_a_warning_naming_it(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    blob = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip_byte":
        i = len(blob) // 2
        newest.write_bytes(blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1:])
    elif damage == "drop_manifest":
        (tmp_path / "ckpt-00000020.json").unlink()
    else:
        newest.unlink()
    with caplog.at_level(logging.WARNING):
        info = checkpoint.newest_valid(tmp_path)
    assert info is not None and info.step == 10
    assert "ckpt-00000020" in caplog.text


def test_resaving_the_same_step_keeps_the_valid_one(tmp_path: Path) -> None:
    first = _save(tmp_path, 7)
    before = first.read_bytes()
    assert _save(tmp_path, 7) == first and first.read_bytes() == before


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    assert checkpoint.newest_valid(tmp_path) is None
    assert checkpoint.newest_valid(tmp_path / "missing") is None


def _writer(folder: Path) -> None:
    """Child process: save checkpoints as fast as possible, forever, until killed."""
    step = 1
    while True:
        _save(folder, step, keep=2, floats=1_000_000)  # 4 MB: each save takes a few ms to write and fsync
        step += 1


def test_random_sigkill_during_saves_always_leaves_a_valid_newest(tmp_path: Path) -> None:
    """At least 20 trials: a writer is SIGKILLed at a random moment; the newest valid checkpoint must load,
    and no partial file (temp, orphan .pt, .pt without matching manifest) is ever taken for it."""
    rng = random.Random(1234)
    caught_mid_write = 0
    for trial in range(24):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        _save(folder, 0, keep=2)  # the run's earlier checkpoint
        pid = os.fork()
        if pid == 0:  # child
            try:
                _writer(folder)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        names = [p.name for p in folder.iterdir()]
        caught_mid_write += any(".tmp-" in n for n in names)
        info = checkpoint.newest_valid(folder)
        assert info is not None, f"trial {trial}: nothing valid in {names}"
        assert checkpoint.load(info, torch.device("cpu"))["step"] == info.step
        newer = [n for n in names if n.endswith(".json") and int(n[5:13]) > info.step]
        assert all(checkpoint._validate(folder / n, warn=False) is None for n in newer), (trial, names)
    # The kills must really hit saves in progress, or this test proves nothing.
    assert caught_mid_write >= 3, caught_mid_write


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "size=256k") as mnt:
        yield mnt


def test_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays(tiny_tmpfs: Path) -> None:
    _save(tiny_tmpfs, 1, floats=10_000)  # 40 kB: fits
    with pytest.raises(CheckpointError, match=r"is full \(no space left.*previous checkpoints are intact"):
        _save(tiny_tmpfs, 2, floats=100_000)  # 400 kB: does not
    info = checkpoint.newest_valid(tiny_tmpfs)
    assert info is not None and info.step == 1
    assert not [p for p in tiny_tmpfs.iterdir() if ".tmp-" in p.name]  # no temp file eats the space


def test_unwritable_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        checkpoint.check_writable(blocker / "ckpts")
