"""Read the trainer's checkpoints on a node without torch: their manifests (docs/DESIGN.md §2), checked against the files.

A checkpoint counts only when its manifest exists and the .pt's size and sha256 match (sha256 computed on
the node, path quoted). An FSDP checkpoint is a step folder (trainer/contract.py): it counts only when its
manifest.json exists, lists a shard of every rank, and every file it lists matches. Newest = highest step
among valid ones, of either kind.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from typing import Any

from orchestrate.probe.observations import Checkpoint
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection
from trainer.contract import (
    CKPT_FOLDER_RE,
    MANIFEST_RE,
    SHARDED_MANIFEST,
    Manifest,
    ShardedManifest,
)


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
