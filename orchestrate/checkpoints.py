"""Read the trainer's files on a node without torch: checkpoint manifests (docs/DESIGN.md §2) and metrics.

A checkpoint counts only when its manifest exists and the .pt's size and sha256 match (sha256 computed on
the node, path quoted). Newest = highest step among valid ones.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from .ssh import Connection

MANIFEST_RE = re.compile(r"^ckpt-(\d{8})\.json$")


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

    @property
    def path(self) -> str:
        return posixpath.join(self.folder, self.file)


def _read_json(conn: Connection, path: str) -> Any:
    return json.loads(conn.read_file(path).decode())


def list_manifests(conn: Connection, folder: str) -> list[str]:
    return sorted((n for n in conn.list_dir(folder) if MANIFEST_RE.match(n)), reverse=True)


def validate(conn: Connection, folder: str, name: str) -> Checkpoint | None:
    """The checkpoint a manifest describes, if the manifest parses and the .pt matches it."""
    try:
        data = _read_json(conn, posixpath.join(folder, name))
        pt = posixpath.join(folder, posixpath.basename(str(data["file"])))
        # One exec: a regular file (-f, not a planted symlink: -L) of the manifest's size, then its hash.
        res = conn.run(["sh", "-c", 'test -f "$1" && ! test -L "$1" && stat -c %s -- "$1" && sha256sum -- "$1"',
                        "check", pt], timeout=300)
        words = res.out.split()
        if res.rc != 0 or words[:2] != [str(int(data["bytes"])), str(data["sha256"])]:
            return None
        return Checkpoint(conn.host.label, folder, posixpath.basename(pt), int(data["step"]), int(data["epoch"]),
                          bool(data.get("epoch_complete", True)), int(data["bytes"]), str(data["sha256"]),
                          posixpath.join(folder, name))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_valid(conn: Connection, folder: str) -> Checkpoint | None:
    """Walk manifests from the highest step down; return the first that checks out."""
    for name in list_manifests(conn, folder):
        found = validate(conn, folder, name)
        if found is not None:
            return found
    return None


def newest_manifest(conn: Connection, folder: str) -> dict[str, Any] | None:
    """The newest manifest's content, without hashing (cheap, for `status`)."""
    for name in list_manifests(conn, folder):
        try:
            return dict(_read_json(conn, posixpath.join(folder, name)))
        except (OSError, ValueError):
            continue
    return None


def last_metrics(conn: Connection, folder: str) -> dict[str, Any] | None:
    try:
        text = conn.read_file(posixpath.join(folder, "metrics.jsonl")).decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return dict(json.loads(lines[-1])) if lines else None
    except (OSError, ValueError):
        return None


def copy_checkpoint(src: Connection, ckpt: Checkpoint, dst: Connection, folder: str) -> None:
    """Copy a checkpoint to another node's checkpoint dir: the .pt first, the manifest last (so it counts only
    once complete), each streamed into an unpredictable temporary name and renamed into place."""
    for name in (ckpt.file, posixpath.basename(ckpt.manifest)):
        dst.write_file(posixpath.join(folder, name), src.stream_file(posixpath.join(ckpt.folder, name)))
