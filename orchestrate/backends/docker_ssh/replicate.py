"""Copy checkpoints between nodes: the resume checkpoint to the nodes that lack it (before the start), and the
replicas of each new one to another node and this machine's mirror while the job runs (--ckpt-mirror). What is
copied is read and validated by checkpoints.py."""

from __future__ import annotations

import hashlib
import posixpath
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrate.backends.docker_ssh.checkpoints import list_manifests, validate
from orchestrate.errors import SSHError
from orchestrate.localfs import write_atomically
from orchestrate.probe.observations import Checkpoint
from orchestrate.remote.ssh import Connection
from trainer.contract import METRICS_FILE


def copy_checkpoint(src: Connection, ckpt: Checkpoint, dst: Connection, folder: str) -> None:
    """Copy a checkpoint to another node's checkpoint dir: the .pt (or the step folder's files) first, the
    manifest last (so it counts only once complete), each streamed into an unpredictable temporary name and
    renamed into place."""
    if ckpt.manifest_name != posixpath.basename(ckpt.manifest):
        dst.run(["mkdir", "-p", "--", posixpath.join(folder, ckpt.file)], timeout=60, check=True)
    for name in (*(f[0] for f in ckpt.files), ckpt.manifest_name):
        dst.write_file(posixpath.join(folder, name), src.stream_file(posixpath.join(ckpt.folder, name)))


REPLICATE_POLL_S = 5.0


FINAL_COPY_S = 600.0  # at a job's end: the longest wait for a copy under way before the final one
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

    def finish(self) -> None:
        """The job is done: its final checkpoint, written after the last poll, is replicated too, once the copy
        under way (if any) has ended. Without it node 1 held the checkpoint before the final one, and a node 0 lost
        after the job's end lost its result."""
        self.stop_event.set()
        if self.thread.ident is None:
            return  # never started: one node and no mirror
        self.thread.join(timeout=1.0)
        if self.thread.is_alive():
            self._say("waiting for the checkpoint copy under way, then the final checkpoint is copied")
            self.thread.join(timeout=FINAL_COPY_S)  # each SSH step of a copy has its own timeout
        if self.thread.is_alive():
            self._say(f"checkpoint replication: a copy still runs after {FINAL_COPY_S:.0f} s; the final checkpoint "
                      "stays on node 0 only")
            return
        try:
            self.replicate_newest()
        except Exception as err:  # reported: the job itself succeeded
            self._say(f"checkpoint replication failed: {' '.join(str(err).split())}")

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
        # Only this `up`'s first checkpoint can be there already (the one a resumed job started from, copied by the
        # `up` before): later ones are new, and asking node 1 would cost an SSH round trip each.
        if self.done is None:
            held = validate(dst, folder, ckpt.manifest_name)
            if held is not None and held.files == ckpt.files:
                return
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
        if self.done is None and self._mirror_holds(ckpt):
            return  # there already (a resumed job's checkpoint), as on node 1
        src = self.nodes.conn(0)
        for name, size, sha in ckpt.files:  # write_atomically makes the step folder
            local = self.mirror / name
            write_atomically(local, src.stream_file(posixpath.join(ckpt.folder, name)))
            if _sha256(local) != sha or local.stat().st_size != size:
                local.unlink(missing_ok=True)
                raise OSError(f"the mirror copy of {name} does not match its manifest")
        write_atomically(self.mirror / ckpt.manifest_name, src.stream_file(ckpt.manifest))
        self._say(f"checkpoint step {ckpt.step} copied to {self.mirror}, sha256 verified")

    def _mirror_holds(self, ckpt: Checkpoint) -> bool:
        assert self.mirror is not None
        return (self.mirror / ckpt.manifest_name).is_file() and all(
            (self.mirror / name).is_file() and (self.mirror / name).stat().st_size == size
            and _sha256(self.mirror / name) == sha for name, size, sha in ckpt.files)

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
