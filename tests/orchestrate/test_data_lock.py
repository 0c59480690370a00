"""The data folder's lock (orchestrate/remote/scripts/data_lock.sh), run here under sh with the real flock(1), as
on a node over SSH: a second holder waits for the first (saying BUSY), gives up after its bound, and a login that
may not write the folder (uid 65534, with setpriv: the suite runs as root) still waits for the copy being made.
The orchestrator's side reads the script's lines from a recorded channel."""

from __future__ import annotations

import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from orchestrate.backends.docker_ssh import datalock
from orchestrate.errors import SSHError

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


class Holder:
    """The script running as on a node; its lines arrive on a queue, so every wait has a bound."""

    def __init__(self, folder: Path, wait_s: int = 60, prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen([*prefix, "sh", "-c", datalock.SCRIPT, "data-lock", str(folder), str(wait_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("<end>")

    def next_line(self, timeout: float = 10) -> str:
        return self.lines.get(timeout=timeout)

    def release(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the SSH channel closing
        return self.proc.wait(timeout=10)


def test_a_second_holder_waits_for_the_first_then_holds_the_lock(tmp_path: Path) -> None:
    first = Holder(tmp_path)
    assert first.next_line() == "LOCKED WRITE"
    second = Holder(tmp_path)
    assert second.next_line() == "BUSY"
    with pytest.raises(queue.Empty):
        second.next_line(timeout=0.5)  # still waiting while the first holds it
    assert first.release() == 0
    assert second.next_line() == "LOCKED WRITE"
    assert second.release() == 0
    assert (tmp_path / ".ddp-cifar.lock").stat().st_mode & 0o777 == 0o666  # another login can open it


def test_the_wait_is_bounded(tmp_path: Path) -> None:
    first = Holder(tmp_path)
    assert first.next_line() == "LOCKED WRITE"
    second = Holder(tmp_path, wait_s=1)
    assert second.next_line() == "BUSY"
    assert second.next_line() == "<end>"
    assert second.proc.wait(timeout=10) == 7
    first.release()


def test_a_login_that_may_not_write_the_folder_waits_then_only_reads() -> None:
    folder = Path(tempfile.mkdtemp(prefix="data-lock-", dir="/tmp"))  # root's, 0755: uid 65534 reads, never writes
    folder.chmod(0o755)
    try:
        first = Holder(folder)
        assert first.next_line() == "LOCKED WRITE"
        other = Holder(folder, prefix=tuple(NOBODY))
        assert other.next_line() == "BUSY"
        first.release()
        assert other.next_line() == "LOCKED READ root (uid 0)"
        other.release()
    finally:
        shutil.rmtree(folder)


class RecordedChannel:
    """What a node's script printed, as paramiko's channel hands it out."""

    def __init__(self, out: bytes, err: bytes = b"") -> None:
        self.out, self.err = [out[i:i + 3] for i in range(0, len(out), 3)], err

    def recv(self, n: int) -> bytes:
        return self.out.pop(0) if self.out else b""

    def recv_stderr(self, n: int) -> bytes:
        return self.err


def until_locked(out: bytes, err: bytes = b"") -> tuple[datalock.Held, list[str]]:
    said: list[str] = []
    held = datalock._until_locked(RecordedChannel(out, err), "h1", "/d", said.append, 120)  # type: ignore[arg-type]
    return held, said


def test_the_wait_is_said_in_one_line_and_its_end_in_another() -> None:
    held, said = until_locked(b"BUSY\nLOCKED WRITE\n")
    assert held.writable and held.owner == ""
    assert said[0] == "data on h1: another up is filling /d; waiting for it (at most 2 min)"
    assert said[1].startswith("data on h1: the other up's copy in /d is done after ")


def test_a_folder_of_another_login_is_refused_with_its_owner_when_it_lacks_the_data() -> None:
    held, said = until_locked(b"LOCKED READ alice (uid 1001)\n")
    assert not held.writable and said == []
    assert str(held.refuse("/d", "holds no verified copy")) == (
        "data folder /d belongs to alice (uid 1001) and holds no verified copy, and this login may not write "
        "there; ask them to run `up` once, or set data_dir= to a folder of yours")


def test_a_lock_that_stays_held_is_one_line_and_a_broken_script_names_its_error() -> None:
    with pytest.raises(datalock.DataFolderError, match="^data folder /d stayed locked by another up for 2 min"):
        until_locked(b"BUSY\n")
    with pytest.raises(SSHError, match="^cannot lock data folder /d: sh: flock: not found$"):
        until_locked(b"", b"sh: flock: not found\n")
