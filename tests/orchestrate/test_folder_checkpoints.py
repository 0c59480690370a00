"""FSDP step-folder checkpoints as the orchestrator sees them on a node: found, verified (sizes and sha256,
without torch), copied to another node and into --ckpt-mirror. The node is this machine: the checks run as
real `sh`, `stat` and `sha256sum` commands; only the SSH transport is replaced."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console

from orchestrate.backends.docker_ssh import checkpoints, replicate
from orchestrate.remote.ssh import Result
from trainer.contract import SHARDED_FORMAT, ckpt_folder_name


class LocalConn:
    """Connection's file and command calls, run on this machine."""

    def __init__(self, label: str) -> None:
        self.host = SimpleNamespace(label=label)

    def run(self, argv: list[str], timeout: float = 60.0, check: bool = False) -> Result:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)
        return Result(done.returncode, done.stdout, done.stderr)

    def read_file(self, path: str, timeout: float = 60.0) -> bytes:
        return Path(path).read_bytes()

    def stream_file(self, path: str, timeout: float = 3600.0) -> Iterator[bytes]:
        yield Path(path).read_bytes()

    def list_dir(self, path: str) -> list[str]:
        return [p.name for p in Path(path).iterdir()] if Path(path).is_dir() else []

    def write_file(self, path: str, chunks: Iterator[bytes], timeout: float = 3600.0) -> None:
        Path(path).write_bytes(b"".join(chunks))


def make_folder(ckpt_dir: Path, step: int, world: int = 2) -> Path:
    """A step folder as trainer/dcp_checkpoint.py seals it (made-up bytes: nothing here loads them)."""
    where = ckpt_dir / ckpt_folder_name(step)
    where.mkdir(parents=True)
    blobs = {".metadata": b"index", "trainer.pt": b"trainer state" * 7,
             **{f"__{r}_0.distcp": bytes([r]) * (1000 * r) for r in range(world)}}  # rank 0's is empty
    for name, blob in blobs.items():
        (where / name).write_bytes(blob)
    files = {n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in blobs.items()}
    manifest = {"format": SHARDED_FORMAT, "strategy": "fsdp", "step": step, "epoch": 1, "epoch_complete": False,
                "world_size": world, "files": files}
    (where / "manifest.json").write_text(json.dumps(manifest))
    return where


def find(ckpt_dir: Path) -> checkpoints.Checkpoint | None:
    return checkpoints.newest_valid(LocalConn("n0"), str(ckpt_dir))  # type: ignore[arg-type]


def test_newest_valid_folder_beats_an_older_pt_and_lists_every_file(tmp_path: Path) -> None:
    (tmp_path / "ckpt-00000005.json").write_text("{}")  # an older (here unreadable) DDP manifest: never chosen
    make_folder(tmp_path, 10, world=3)
    found = find(tmp_path)
    assert found is not None and found.step == 10 and found.file == "ckpt-00000010"
    assert found.manifest_name == "ckpt-00000010/manifest.json"
    assert sorted(n for n, _, _ in found.files) == ["ckpt-00000010/.metadata", "ckpt-00000010/__0_0.distcp",
                                                    "ckpt-00000010/__1_0.distcp", "ckpt-00000010/__2_0.distcp",
                                                    "ckpt-00000010/trainer.pt"]


def test_a_torn_folder_a_wrong_sha_a_missing_shard_or_a_symlink_never_count(tmp_path: Path) -> None:
    make_folder(tmp_path, 10)
    make_folder(tmp_path, 20).joinpath("manifest.json").unlink()  # torn: a copy cut before its manifest
    bad_sha = make_folder(tmp_path, 30)
    (bad_sha / "__1_0.distcp").write_bytes(b"\x02" * 1000)  # same size, other bytes
    make_folder(tmp_path, 40).joinpath("__0_0.distcp").unlink()  # a shard the manifest lists is gone
    unlisted = make_folder(tmp_path, 50)  # sealed without rank 1's shard: the manifest does not list it
    data = json.loads((unlisted / "manifest.json").read_text())
    del data["files"]["__1_0.distcp"]
    (unlisted / "manifest.json").write_text(json.dumps(data))
    linked = make_folder(tmp_path, 60)
    (linked / "trainer.pt").rename(tmp_path / "elsewhere.pt")
    (linked / "trainer.pt").symlink_to(tmp_path / "elsewhere.pt")  # right bytes, but not a file in the folder
    (tmp_path / ".ckpt-00000070.tmp").mkdir()  # a save under way
    found = find(tmp_path)
    assert found is not None and found.step == 10


def test_copy_to_another_node_verifies_there_and_status_names_the_folder(tmp_path: Path) -> None:
    src, dst = tmp_path / "node0", tmp_path / "node1"
    make_folder(src, 10)
    dst.mkdir()
    ckpt = find(src)
    assert ckpt is not None
    replicate.copy_checkpoint(LocalConn("n0"), ckpt, LocalConn("n1"), str(dst))  # type: ignore[arg-type]
    copy = checkpoints.validate(LocalConn("n1"), str(dst), ckpt.manifest_name)  # type: ignore[arg-type]
    assert copy is not None and copy.host == "n1" and copy.step == 10
    shown = checkpoints.newest_manifest(LocalConn("n1"), str(dst))  # type: ignore[arg-type]
    assert shown is not None and shown["file"] == "ckpt-00000010" and shown["epoch"] == 1


class OneNode:
    def conn(self, rank: int) -> Any:
        return LocalConn(f"n{rank}")


def test_replicator_mirrors_a_folder_checkpoint_that_then_counts_there(tmp_path: Path) -> None:
    node0, mirror = tmp_path / "node0", tmp_path / "mirror"
    make_folder(node0, 10)
    specs = [SimpleNamespace(dirs={"ckpt": str(node0)})]
    rep = replicate.Replicator(OneNode(), specs, mirror, Console(quiet=True))
    done = rep.replicate_newest()
    assert done is not None and done.step == 10
    again = find(mirror)
    assert again is not None and again.step == 10 and again.files == done.files


def test_the_final_checkpoint_written_after_the_last_poll_is_replicated_when_the_job_is_done(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The gate: the thread's next poll never comes (an hour away), as when the job writes its final checkpoint
    and exits between two polls; `finish` copies it to node 1 (seen on the devcluster: node 1's newest replica
    was the checkpoint before the final one)."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    make_folder(node0, 10)
    (node0 / "metrics.jsonl").write_text("{}\n")
    node1.mkdir()
    monkeypatch.setattr(replicate, "REPLICATE_POLL_S", 3600.0)
    specs = [SimpleNamespace(dirs={"ckpt": str(node0)}), SimpleNamespace(dirs={"ckpt": str(node1)})]
    rep = replicate.Replicator(OneNode(), specs, None, Console(quiet=True))
    assert rep.replicate_newest() is not None  # the last poll: step 10 copied
    rep.start()
    make_folder(node0, 20)  # the final checkpoint, then the job ends
    rep.finish()
    assert not rep.thread.is_alive()
    copy = find(node1)
    assert copy is not None and copy.step == 20


def test_the_next_up_copies_no_checkpoint_that_node_1_and_the_mirror_hold_already(tmp_path: Path) -> None:
    """`up --resume`: the newest checkpoint is the one the job resumes from, replicated by the `up` before; a
    second copy sent the same bytes over the network again (seen in the README's demo: 'checkpoint step 62 copied'
    right after resuming from step 62). A replica that no longer matches is copied again."""
    node0, node1, mirror = tmp_path / "node0", tmp_path / "node1", tmp_path / "mirror"
    make_folder(node0, 10)
    (node0 / "metrics.jsonl").write_text("{}\n")
    node1.mkdir()
    specs = [SimpleNamespace(dirs={"ckpt": str(node0)}), SimpleNamespace(dirs={"ckpt": str(node1)})]
    said = io.StringIO()
    first = replicate.Replicator(OneNode(), specs, mirror, Console(file=said, width=200))
    assert first.replicate_newest() is not None and said.getvalue().count("copied") == 2  # node 1, the mirror
    said.truncate(0)
    said.seek(0)
    second = replicate.Replicator(OneNode(), specs, mirror, Console(file=said, width=200))
    assert second.replicate_newest() is not None and "copied" not in said.getvalue() and second.made == []
    (node1 / "ckpt-00000010" / "__1_0.distcp").write_bytes(b"\x09" * 1000)  # node 1's copy went bad
    third = replicate.Replicator(OneNode(), specs, mirror, Console(file=said, width=200))
    assert third.replicate_newest() is not None and "copied to node 1" in said.getvalue()
    assert find(node1) is not None
