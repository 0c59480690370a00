"""Read the trainer's files on a node without torch: checkpoint manifests (docs/DESIGN.md §2) and metrics.

A checkpoint counts only when its manifest exists and the .pt's size and sha256 match (sha256 computed on
the node, path quoted). Newest = highest step among valid ones.
"""

from __future__ import annotations

import json
import posixpath
import re
import stat
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
    with conn.sftp().open(path) as fh:
        return json.loads(fh.read().decode())


def list_manifests(conn: Connection, folder: str) -> list[str]:
    try:
        names = conn.sftp().listdir(folder)
    except OSError:
        return []
    return sorted((n for n in names if MANIFEST_RE.match(n)), reverse=True)


def validate(conn: Connection, folder: str, name: str) -> Checkpoint | None:
    """The checkpoint a manifest describes, if the manifest parses and the .pt matches it."""
    try:
        data = _read_json(conn, posixpath.join(folder, name))
        pt = posixpath.join(folder, posixpath.basename(str(data["file"])))
        info = conn.sftp().stat(pt)
        if not stat.S_ISREG(info.st_mode or 0) or info.st_size != int(data["bytes"]):
            return None
        res = conn.run(["sha256sum", "--", pt], timeout=300)
        if res.rc != 0 or res.out.split()[:1] != [str(data["sha256"])]:
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
        with conn.sftp().open(posixpath.join(folder, "metrics.jsonl")) as fh:
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        return dict(json.loads(lines[-1])) if lines else None
    except (OSError, ValueError):
        return None


def copy_checkpoint(src: Connection, ckpt: Checkpoint, dst: Connection, folder: str) -> None:
    """Copy a checkpoint (.pt first, manifest last, each via a temp name) to another node's checkpoint dir."""
    for name in (ckpt.file, posixpath.basename(ckpt.manifest)):
        tmp = posixpath.join(folder, f".{name}.copy")
        with src.sftp().open(posixpath.join(ckpt.folder, name), "rb") as fin, dst.sftp().open(tmp, "wb") as fout:
            fin.prefetch()
            while True:
                block = fin.read(1 << 20)
                if not block:
                    break
                fout.write(block)
        dst.sftp().posix_rename(tmp, posixpath.join(folder, name))
