"""The resume search over nodes' checkpoint folders, read through Docker over SSH's Daemons.newest_checkpoint: a
corrupted replica is skipped with a warning. The folders are real (tmp_path) and the size + sha256 check is the real
command, run here instead of over SSH. Then the plan's choice among what each node holds (plan/resume.py), as a
table."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.errors import NoCheckpointError
from orchestrate.plan.resume import ResumePoint, choose_resume, resume_line
from orchestrate.probe.observations import Checkpoint
from orchestrate.probe.resume import newest_checkpoints
from orchestrate.remote.ssh import Result


class LocalConn:
    """A node whose commands run on this machine (its checkpoint folder is a tmp folder)."""

    def __init__(self, label: str) -> None:
        self.host = SimpleNamespace(label=label)

    def run(self, argv: list[str], timeout: float = 60) -> Result:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return Result(res.returncode, res.stdout, res.stderr)

    def read_file(self, path: str, timeout: float = 60) -> bytes:
        return Path(path).read_bytes()

    def list_dir(self, path: str) -> list[str]:
        return sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []


def save(folder: Path, step: int, payload: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ckpt-{step:08d}.pt").write_bytes(payload)
    manifest = {"format": 1, "file": f"ckpt-{step:08d}.pt", "sha256": hashlib.sha256(payload).hexdigest(),
                "bytes": len(payload), "step": step, "epoch": step // 8, "epoch_complete": True, "world_size": 3}
    (folder / f"ckpt-{step:08d}.json").write_text(json.dumps(manifest))


def corrupt(folder: Path, step: int) -> None:
    """One byte flipped in place: the size is right, the sha256 is not (bit rot, a torn copy)."""
    pt = folder / f"ckpt-{step:08d}.pt"
    data = bytearray(pt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt.write_bytes(bytes(data))


def test_a_corrupted_replica_is_skipped_with_a_warning_and_the_next_valid_checkpoint_is_used(tmp_path: Path) -> None:
    """Node 0 is lost; the survivors are the replica holder (node 1, now rank 0) and node 2. The newest replica
    (step 24) is corrupted: the search warns, names it, and resumes from step 16, held by both."""
    replica, other = tmp_path / "n1", tmp_path / "n2"
    for step in (16, 24):
        save(replica, step, bytes([step]) * 4096)
    save(other, 16, bytes([16]) * 4096)
    corrupt(replica, 24)
    conns = [LocalConn("h1"), LocalConn("h2")]
    nodes: Any = SimpleNamespace(conn=lambda r: conns[r], hosts=[c.host for c in conns])
    out = io.StringIO()
    held = newest_checkpoints(DockerSSH(), nodes, ["h1", "h2"], [str(replica), str(other)],
                              Console(file=out, width=300))
    assert [c.step if c else None for c in held] == [16, 16] and [c.host for c in held if c] == ["h1", "h2"]
    found = choose_resume(held, ["h1", "h2"], [str(replica), str(other)])
    assert found.checkpoint.step == 16 and found.source == 0
    assert found.copy_to == ()  # both hold step 16: nothing to copy
    warned = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: h1:{replica}/ckpt-00000024.json: the checkpoint does not match its manifest "
                      "(missing, or another size or sha256): skipped"]
    assert resume_line(found) == f"resuming from h1:{replica}/ckpt-00000016.pt (epoch 2, step 16, sha256 verified)"


def held(host: str, step: int) -> Checkpoint:
    return Checkpoint(host, f"/c/{host}", f"ckpt-{step:08d}.pt", step, step // 8, True, 10, "0" * 64, "m.json")


@pytest.mark.parametrize(("found", "source", "step", "copy_to"), [
    ([held("a", 8), None, None], 0, 8, (1, 2)),  # one node holds one: copied to the two that hold none
    ([None, held("b", 16), held("c", 8)], 1, 16, (0, 2)),  # the newest wins; an older one counts as lacking it
    ([held("a", 16), held("b", 16), held("c", 24)], 2, 24, (0, 1)),  # the newest, wherever it is
    ([held("a", 16), held("b", 16), held("c", 8)], 0, 16, (2,)),  # a tie: the first node serves, the other has it
    ([None, held("b", 16), held("c", 16)], 1, 16, (0,)),
])
def test_the_newest_checkpoint_on_any_node_is_chosen_and_copied_to_the_nodes_without_it(
        found: list[Checkpoint | None], source: int, step: int, copy_to: tuple[int, ...]) -> None:
    point = choose_resume(found, ["a", "b", "c"], ["/c/a", "/c/b", "/c/c"])
    assert point == ResumePoint(found[source], source, copy_to)  # type: ignore[arg-type]
    assert point.checkpoint.step == step


def test_no_checkpoint_on_any_node_is_one_error_naming_every_folder() -> None:
    with pytest.raises(NoCheckpointError) as refused:
        choose_resume([None, None], ["a", "b"], ["/c/a", "/d/b"])
    assert str(refused.value) == "--resume: no valid checkpoint of this job in a:/c/a, b:/d/b; start it without --resume"
