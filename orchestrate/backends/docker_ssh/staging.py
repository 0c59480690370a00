"""`up --data-from DIR` (or a single file for another program): the folder synced into every node's data dir,
incrementally.

Local side: a manifest of every file (relative path, size, sha256). Node side: `find` lists the files with size
and mtime; a file whose (size, mtime) match the record of the last sync (`.ddp-staged.json` in the data dir) keeps
that record's sha256, any other is hashed on the node (`sha256sum`), so a file changed or corrupted there since is
found. Missing or different files travel in one tar stream over one SSH channel, are unpacked into a temporary
folder inside the data dir and renamed into place (a reader never sees half a file). Files on the node that are
not in the source are left alone. Nothing here needs more than sh, find, sha256sum, tar and mv on the node.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrate.backends.docker_ssh.datalock import data_lock
from orchestrate.errors import ConfigError, SSHError
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection
from trainer.errors import shown

NODE_MANIFEST = ".ddp-staged.json"
STAGING_PREFIX = ".ddp-staging."


class NoSpaceError(SSHError):
    """The data folder cannot hold the files to stage."""


LIST_SCRIPT = scripts.text("stage_list.sh")
HASH_SCRIPT = scripts.text("stage_hash.sh")
PUT_SCRIPT = scripts.text("stage_put.sh")


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str


@dataclass(frozen=True)
class StageResult:
    label: str
    files: int  # in the source
    changed: list[str]
    bytes_sent: int  # from here
    via: str | None = None  # the relay node it fetched the changed files from (--relay)

    def describe(self) -> str:
        if not self.changed:
            return f"up to date, nothing moved ({self.files} files)"
        if self.via is not None:
            return f"{len(self.changed)} of {self.files} files changed, fetched from the relay on {self.via}, " \
                   "0 bytes sent from here"
        return f"{len(self.changed)} of {self.files} files changed, {self.bytes_sent} bytes sent"


def local_manifest(source: Path) -> dict[str, Entry]:
    """Relative path -> size and sha256 of every file under `source` (or of `source` itself, a single file).
    A symlink that leaves the folder, or an unreadable file, is refused (ConfigError: nothing has started)."""
    if source.is_file():
        return {source.name: _entry(source, source)}
    root = source.resolve()
    found: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
        for name in sorted(dirnames):
            if (Path(dirpath) / name).is_symlink():
                _inside(Path(dirpath) / name, root)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            _inside(path, root)
            if path.is_file():
                found[path.relative_to(source).as_posix()] = _entry(path, source)
    if not found:
        raise ConfigError(f"--data-from {shown(source)}: no files in it; give a folder that holds the program's data")
    return found


def _inside(path: Path, root: Path) -> None:
    target = path.resolve()
    if path.is_symlink() and not target.is_relative_to(root):
        raise ConfigError(f"--data-from: {shown(path)} is a symlink to {shown(target)}, outside {shown(root)}; copy the file in instead")


def _entry(path: Path, source: Path) -> Entry:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            size = 0
            while block := fh.read(1 << 20):
                digest.update(block)
                size += len(block)
    except OSError as err:
        raise ConfigError(f"--data-from {shown(source)}: cannot read {shown(path)}: {err.strerror or err}") from None
    return Entry(size, digest.hexdigest())


def node_state(conn: Connection, data_dir: str) -> dict[str, Entry]:
    """What the node holds now: (size, sha256) per file, hashed on the node where the last sync's record
    does not vouch for it (size and mtime unchanged)."""
    listing = conn.run(["sh", "-c", LIST_SCRIPT, "list", data_dir, STAGING_PREFIX, NODE_MANIFEST], timeout=600)
    if listing.rc != 0:
        raise SSHError(f"cannot list {data_dir}: {listing.err.strip()[-200:]}")
    stats: dict[str, tuple[int, str]] = {}
    for record in listing.out.split("\0"):
        size, _, rest = record.partition(" ")
        mtime, _, rel = rest.partition(" ")
        if rel:
            stats[rel] = (int(size), mtime)
    recorded = _read_record(conn, data_dir)
    known = {rel: Entry(st[0], recorded[rel][2]) for rel, st in stats.items()
             if rel in recorded and (recorded[rel][0], recorded[rel][1]) == st}
    to_hash = sorted(set(stats) - set(known))
    return {**known, **_hash_on_node(conn, data_dir, to_hash, stats)}


def _read_record(conn: Connection, data_dir: str) -> dict[str, tuple[int, str, str]]:
    try:
        data = json.loads(conn.read_file(posixpath.join(data_dir, NODE_MANIFEST), timeout=60))
        return {str(k): (int(v[0]), str(v[1]), str(v[2])) for k, v in data.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}


def _hash_on_node(conn: Connection, data_dir: str, rels: list[str],
                  stats: dict[str, tuple[int, str]]) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for start in range(0, len(rels), 500):  # bounded command lines
        chunk = rels[start:start + 500]
        res = conn.run(["sh", "-c", HASH_SCRIPT, "hash", data_dir, *chunk],
                       timeout=3600)
        for record in res.out.split("\0"):
            digest, _, rel = record.partition("  ")
            if rel in stats:
                out[rel] = Entry(stats[rel][0], digest)
    return out


def changed_files(local: dict[str, Entry], remote: dict[str, Entry]) -> list[str]:
    """PURE: the files to send: missing on the node, or with another size or sha256 there."""
    return sorted(rel for rel, entry in local.items() if remote.get(rel) != entry)


def tar_stream(source: Path, rels: list[str], progress: Callable[[int], None]) -> Iterator[bytes]:
    """An uncompressed tar of `rels` (read from `source`), made block by block as it is sent: a header, the
    file's bytes, padding to 512; two zero blocks at the end. Never more than a block in memory."""
    sent = 0
    for rel in rels:
        path = source if source.is_file() else source / rel
        info = tarfile.TarInfo(rel)
        info.size, info.mode = path.stat().st_size, 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                sent += len(block)
                progress(sent)
                yield block
        if info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


Put = Callable[[list[str], int], str | None]  # sends the changed files (and their total size); the relay it used


def stage_node(conn: Connection, data_dir: str, source: Path, local: dict[str, Entry],
               progress: Callable[[int, int], None], say: Callable[[str], None], put: Put | None = None
               ) -> StageResult:
    """Bring the node's data dir up to `local` under the folder's lock (another `up` staging there is waited
    for, then only what still differs moves); record what it now holds for the next `up`. `put`: how the changed
    files get there (default: sent from here; relay.py's fetch with --relay), checked here as they landed."""
    via = None
    with data_lock(conn, data_dir, say) as held:
        changed = changed_files(local, node_state(conn, data_dir))
        if changed and not held.writable:
            raise held.refuse(data_dir, f"{len(changed)} files of --data-from differ there")
        total = sum(local[rel].size for rel in changed)
        if changed:
            if put is None:
                send_changed(conn, data_dir, source, changed, total, progress)
            else:
                via = put(changed, total)
            after = node_state(conn, data_dir)
            wrong = [rel for rel in changed if after.get(rel) != local[rel]]
            if wrong:
                raise SSHError(f"{wrong[0]} in {data_dir} does not match the source after the copy")
        if held.writable:
            _write_record(conn, data_dir, local)
    return StageResult(conn.host.label, len(local), changed, 0 if via else total, via)


def send_changed(conn: Connection, data_dir: str, source: Path, changed: list[str], total: int,
         progress: Callable[[int, int], None]) -> None:
    """Send the changed files when the folder can hold them; a failed unpack leaves nothing partial (PUT_SCRIPT
    removes its temporary folder), and one that ran out of room says how much was needed."""
    check_space(conn, data_dir, total)
    res = conn.run_streaming(unpack_command(data_dir),
                             tar_stream(source, changed, lambda n: progress(min(n, total), total)),
                             timeout=24 * 3600)
    if res.rc != 0:
        check_space(conn, data_dir, total)  # the disk filled meanwhile: say so, with the figures
        raise SSHError(f"unpacking into {data_dir} failed: {res.err.strip()[-300:]}")


def unpack_command(data_dir: str) -> list[str]:
    """The node's command that unpacks a tar of changed files (on its stdin) into `data_dir`, whole files only."""
    return ["sh", "-c", PUT_SCRIPT, "put", data_dir, STAGING_PREFIX]


def check_space(conn: Connection, data_dir: str, need: int) -> None:
    free = free_bytes(conn, data_dir)
    if need > free:
        raise NoSpaceError(f"data staging into {data_dir} failed: no space left for the changed "
                           f"files: they need {need / 1e6:.1f} MB, the folder had {free / 1e6:.1f} MB free; free some "
                           "space there or choose another data dir")


def free_bytes(conn: Connection, folder: str) -> int:
    """Bytes the login may still write in `folder` (df's available blocks, POSIX format)."""
    res = conn.run(["df", "-Pk", "--", folder], timeout=60, check=True)
    fields = (res.out.strip().splitlines()[-1:] or [""])[0].split()
    try:
        return int(fields[3]) * 1024
    except (IndexError, ValueError):
        raise SSHError(f"cannot read the free space of {folder} (df printed {res.out!r})") from None


def _write_record(conn: Connection, data_dir: str, local: dict[str, Entry]) -> None:
    listing = conn.run(["sh", "-c", LIST_SCRIPT, "list", data_dir, STAGING_PREFIX, NODE_MANIFEST], timeout=600)
    record = {}
    for entry in listing.out.split("\0"):
        size, _, rest = entry.partition(" ")
        mtime, _, rel = rest.partition(" ")
        if rel in local and int(size) == local[rel].size:
            record[rel] = [int(size), mtime, local[rel].sha256]
    conn.write_file(posixpath.join(data_dir, NODE_MANIFEST), iter((json.dumps(record).encode(),)), timeout=60)
