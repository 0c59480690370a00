"""The one atomic write (trainer/atomic.py) and its callers on both sides: the checkpoint files, the heartbeat and
metrics rewrite, the orchestrator's local state. Needs nothing (no torch for atomic.py itself)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrate import localfs
from trainer import atomic, checkpoint, metrics
from trainer.contract import HEARTBEAT_FILE

# Each caller's write, and the mode bits its file must have whatever the umask: the trainer's files are read by
# the orchestrator's login (another account than the container's); what the orchestrator keeps is its user's.
WRITERS: dict[str, tuple[Callable[[Path, bytes], None], int]] = {
    "checkpoint": (lambda p, b: checkpoint._write_atomic(p, b), 0o644),
    "heartbeat": (lambda p, b: metrics.write_text_atomic(p, b.decode()), 0o644),
    "orchestrate-state": (lambda p, b: localfs.write_atomically(p, [b[:3], b[3:]]), 0o600),
}


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_each_writer_replaces_the_file_whole_with_its_mode_and_leaves_no_temp(writer: str, tmp_path: Path,
                                                                            strict_umask: None) -> None:
    write, mode = WRITERS[writer]
    target = tmp_path / "f.json"
    target.write_text("old")
    write(target, b'{"new": 1}')
    assert target.read_bytes() == b'{"new": 1}'
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_each_writer_syncs_the_file_then_the_folder(writer: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A power cut after the write keeps the new file: its bytes are on disk before the rename, and the rename
    (the folder's entry) after it."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    WRITERS[writer][0](tmp_path / "f.json", b"{}")
    assert synced == ["file", "folder"]


def test_a_failing_source_keeps_the_old_file_and_removes_the_temp(tmp_path: Path) -> None:
    """The orchestrator streams a checkpoint over SSH into its mirror: a connection lost midway leaves what was
    there before, and no temp file."""
    target = tmp_path / "ckpt-00000008.pt"
    target.write_bytes(b"before")

    def chunks() -> Iterator[bytes]:
        yield b"half"
        raise ConnectionError("lost")

    with pytest.raises(ConnectionError):
        atomic.write_atomic(target, chunks(), mode=0o600)
    assert target.read_bytes() == b"before"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_only_temp_files_of_other_processes_are_stale(tmp_path: Path) -> None:
    """The trainer's prune deletes the temp files a killed writer left, never one this process is writing."""
    assert atomic.is_stale_temp(f".heartbeat.json{atomic.TMP_MARK}{os.getpid() + 1}-x1y2")
    assert not atomic.is_stale_temp(f".heartbeat.json{atomic.TMP_MARK}{os.getpid()}-x1y2")
    assert not atomic.is_stale_temp("heartbeat.json") and not atomic.is_stale_temp(".hidden")


def test_the_heartbeat_is_renamed_into_place_without_an_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 writes it every HEARTBEAT_S on its training thread: two fsyncs each time cost every rank 10-100 ms on
    NFS or Lustre. Atomic still: the beat appears whole under its name and no temp file is left. Before the fix
    2 fsyncs per beat (seen)."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    beat = metrics.Heartbeat(tmp_path, enabled=True, total_steps=10, epochs=1, global_batch=8)
    beat.mark("training", step=1)
    assert synced == []
    assert json.loads((tmp_path / HEARTBEAT_FILE).read_text())["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [HEARTBEAT_FILE]
    metrics.write_json_atomic(tmp_path / "other.json", {})
    assert len(synced) == 2  # every other atomic write stays durable
