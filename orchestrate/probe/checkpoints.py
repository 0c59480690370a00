"""Read the trainer's files on a node without torch: checkpoint manifests (docs/DESIGN.md §2) and metrics.

A checkpoint counts only when its manifest exists and the .pt's size and sha256 match (sha256 computed on
the node, path quoted). An FSDP checkpoint is a step folder (trainer/contract.py): it counts only when its
manifest.json exists, lists a shard of every rank, and every file it lists matches. Newest = highest step
among valid ones, of either kind.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import SSHError
from orchestrate.jobs.memory import write_atomically
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection
from trainer.contract import (
    CKPT_FOLDER_RE,
    MANIFEST_RE,
    METRICS_FILE,
    SHARDED_MANIFEST,
    Manifest,
    ShardedManifest,
)


@dataclass(frozen=True)
class Checkpoint:
    host: str
    folder: str
    file: str
    step: int
    epoch: int
    epoch_complete: bool
    bytes: int
    sha256: str
    manifest: str
    files: tuple[tuple[str, int, str], ...] = ()  # (name relative to folder, bytes, sha256), the manifest not among them

    @property
    def path(self) -> str:
        return posixpath.join(self.folder, self.file)

    @property
    def manifest_name(self) -> str:
        """The manifest relative to the checkpoint dir: ckpt-<step>.json, or ckpt-<step>/manifest.json."""
        return posixpath.relpath(self.manifest, self.folder)


def _read_json(conn: Connection, path: str) -> Any:
    return json.loads(conn.read_file(path).decode())


def list_manifests(conn: Connection, folder: str) -> list[str]:
    """Manifest names relative to `folder`, newest step first: ckpt-<step>.json and ckpt-<step>/manifest.json."""
    names = conn.list_dir(folder)
    found = [n for n in names if MANIFEST_RE.fullmatch(n)]
    found += [posixpath.join(n, SHARDED_MANIFEST) for n in names if CKPT_FOLDER_RE.fullmatch(n)]
    return sorted(found, reverse=True)


def validate(conn: Connection, folder: str, name: str) -> Checkpoint | None:
    """The checkpoint a manifest describes, if the manifest parses and the .pt (or every file of the step
    folder) matches it."""
    if posixpath.basename(name) == SHARDED_MANIFEST:
        return validate_folder(conn, folder, posixpath.dirname(name))
    try:
        m = Manifest.parse(_read_json(conn, posixpath.join(folder, name)))
        pt = posixpath.join(folder, m.file)
        res = conn.run(["sh", "-c", CHECK_FILE, "check", pt], timeout=300)  # one exec: size, then hash
        words = res.out.split()
        if res.rc != 0 or words[:2] != [str(m.bytes), m.sha256]:
            return None
        return Checkpoint(conn.host.label, folder, m.file, m.step, m.epoch, m.epoch_complete, m.bytes, m.sha256,
                          posixpath.join(folder, name), ((m.file, m.bytes, m.sha256),))
    except (OSError, ValueError):
        return None


# One exec per checkpoint: each file's type and size (stat does not follow a planted symlink), then its hash.
CHECK_FILE = scripts.text("checkpoint_file.sh")
CHECK_FOLDER = scripts.text("checkpoint_folder.sh")


def validate_folder(conn: Connection, folder: str, step_dir: str) -> Checkpoint | None:
    """The FSDP checkpoint in folder/step_dir, if its manifest.json parses and every file it lists is a regular
    file of that size and sha256. A torn copy (no manifest), a missing shard or a wrong hash: None."""
    where = posixpath.join(folder, step_dir)
    try:
        m = ShardedManifest.parse(_read_json(conn, posixpath.join(where, SHARDED_MANIFEST)))
        names = sorted(m.files)
        res = conn.run(["sh", "-c", CHECK_FOLDER, "check", where, *names], timeout=300)
        if res.rc != 0 or _folder_seen(res.out, len(names)) != {n: m.files[n] for n in names}:
            return None
    except (OSError, ValueError):
        return None
    files = tuple((posixpath.join(step_dir, n), size, sha) for n, (size, sha) in sorted(m.files.items()))
    return Checkpoint(conn.host.label, folder, step_dir, m.step, m.epoch, m.epoch_complete,
                      sum(size for size, _ in m.files.values()), "", posixpath.join(where, SHARDED_MANIFEST), files)


def _folder_seen(out: str, count: int) -> dict[str, tuple[int, str]]:
    """CHECK_FOLDER's output as name -> (bytes, sha256), regular files only."""
    lines = out.splitlines()
    sizes: dict[str, int] = {}
    for line in lines[:count]:
        kind, size, name = line.rsplit(" ", 2)
        if kind in ("regular file", "regular empty file"):  # stat's words for a file of 0 bytes differ
            sizes[name] = int(size)
    hashes = {name: sha for sha, name in (line.split(maxsplit=1) for line in lines[count:])}
    return {name: (size, hashes.get(name, "")) for name, size in sizes.items()}


def newest_valid(conn: Connection, folder: str, skipped: Callable[[str], None] | None = None) -> Checkpoint | None:
    """Walk manifests from the highest step down; return the first that checks out. `skipped` is told the path of
    each newer manifest whose checkpoint does not (a damaged copy, a corrupted replica)."""
    for name in list_manifests(conn, folder):
        found = validate(conn, folder, name)
        if found is not None:
            return found
        if skipped is not None:
            skipped(posixpath.join(folder, name))
    return None


def newest_manifest(conn: Connection, folder: str) -> dict[str, Any] | None:
    """The newest manifest's content, without hashing (cheap, for `status`)."""
    for name in list_manifests(conn, folder):
        try:
            found = dict(_read_json(conn, posixpath.join(folder, name)))
        except (OSError, ValueError):
            continue
        if posixpath.basename(name) == SHARDED_MANIFEST:  # a step folder: it is "the file" status shows
            found["file"] = posixpath.dirname(name)
        return found
    return None


def last_metrics(conn: Connection, folder: str) -> dict[str, Any] | None:
    try:
        text = conn.read_file(posixpath.join(folder, METRICS_FILE)).decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return dict(json.loads(lines[-1])) if lines else None
    except (OSError, ValueError):
        return None


def copy_checkpoint(src: Connection, ckpt: Checkpoint, dst: Connection, folder: str) -> None:
    """Copy a checkpoint to another node's checkpoint dir: the .pt (or the step folder's files) first, the
    manifest last (so it counts only once complete), each streamed into an unpredictable temporary name and
    renamed into place."""
    if ckpt.manifest_name != posixpath.basename(ckpt.manifest):
        dst.run(["mkdir", "-p", "--", posixpath.join(folder, ckpt.file)], timeout=60, check=True)
    for name in (*(f[0] for f in ckpt.files), ckpt.manifest_name):
        dst.write_file(posixpath.join(folder, name), src.stream_file(posixpath.join(ckpt.folder, name)))


# ---- replication: the newest checkpoint survives its node --------------------------------------------------

REPLICATE_POLL_S = 5.0
KEEP_REPLICAS = 2  # replicas made by this `up` that stay on the other node (older ones are removed)


class Replicator:
    """While a job runs: each new valid checkpoint of node 0 is copied to node 1 (and into `mirror`, a local
    folder), verified there against its manifest, with metrics.jsonl beside it. A thread of the orchestrator:
    training never waits for it. A copy that fails is reported and tried again with the next checkpoint."""

    def __init__(self, nodes: Any, specs: Sequence[Any], mirror: Path | None, console: Any) -> None:
        self.nodes, self.specs, self.mirror, self.console = nodes, specs, mirror, console
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.done: str | None = None  # the newest manifest name already replicated
        self.made: list[Checkpoint] = []  # replicas on node 1, oldest first

    def start(self) -> None:
        if len(self.specs) > 1 or self.mirror is not None:
            self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout=1.0)  # a copy under way is left to finish or fail on its own

    def _run(self) -> None:
        while not self.stop_event.wait(REPLICATE_POLL_S):
            try:
                self.replicate_newest()
            except Exception as err:  # reported; the job goes on, and the next checkpoint is tried again
                self._say(f"checkpoint replication failed: {' '.join(str(err).split())}")

    def replicate_newest(self) -> Checkpoint | None:
        src, folder = self.nodes.conn(0), self.specs[0].dirs["ckpt"]
        names = list_manifests(src, folder)
        if not names or names[0] == self.done:
            return None
        ckpt = validate(src, folder, names[0])
        if ckpt is None:  # being written, or broken: the next poll looks again
            return None
        if len(self.specs) > 1:
            self._to_node(ckpt)
        if self.mirror is not None:
            self._to_mirror(ckpt)
        self.done = names[0]
        return ckpt

    def _to_node(self, ckpt: Checkpoint) -> None:
        """metrics.jsonl first, then the .pt, the manifest last: a replica that counts has its metrics."""
        src, dst, folder = self.nodes.conn(0), self.nodes.conn(1), self.specs[1].dirs["ckpt"]
        try:
            dst.write_file(posixpath.join(folder, METRICS_FILE),
                           src.stream_file(posixpath.join(ckpt.folder, METRICS_FILE)))
        except SSHError:  # a program without metrics.jsonl
            pass
        copy_checkpoint(src, ckpt, dst, folder)
        copy = validate(dst, folder, ckpt.manifest_name)
        if copy is None:
            raise OSError(f"the copy of {ckpt.file} on {dst.host.label} does not match its manifest")
        self.made.append(copy)
        for old in self.made[:-KEEP_REPLICAS]:
            dst.run(["rm", "-rf", "--", old.manifest, old.path], timeout=60)  # manifest first: never a bare one
        self.made = self.made[-KEEP_REPLICAS:]
        self._say(f"checkpoint step {ckpt.step} copied to node 1 ({dst.host.label}), sha256 verified")

    def _to_mirror(self, ckpt: Checkpoint) -> None:
        assert self.mirror is not None
        src = self.nodes.conn(0)
        for name, size, sha in ckpt.files:  # write_atomically makes the step folder
            local = self.mirror / name
            write_atomically(local, src.stream_file(posixpath.join(ckpt.folder, name)))
            if _sha256(local) != sha or local.stat().st_size != size:
                local.unlink(missing_ok=True)
                raise OSError(f"the mirror copy of {name} does not match its manifest")
        write_atomically(self.mirror / ckpt.manifest_name, src.stream_file(ckpt.manifest))
        self._say(f"checkpoint step {ckpt.step} copied to {self.mirror}, sha256 verified")

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
