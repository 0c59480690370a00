"""The one atomic file write, for the trainer (checkpoints, manifests, heartbeat, metrics) and the orchestrator
(its job state, memos, checkpoint mirror). Standard library only: the orchestrator imports it without torch.

A reader never sees half a file, and a crash (of the process or the machine) leaves the old file or the new one:
temp file in the same folder, write, flush, fsync, rename over the target, fsync the folder (so the rename itself
survives a power cut; both fsyncs are left out for a file whose loss is harmless, `durable=False`). Two writers of
one file leave one of theirs whole.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

# Every temp file's name: `.<target name>.tmp-<pid>-<random>`. The pid says whose it is: the trainer's prune
# deletes those of dead writers in its checkpoint dir (is_stale_temp).
TMP_MARK = ".tmp-"


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | memoryview | Iterable[bytes], *, mode: int, durable: bool = True) -> None:
    """Write `data` (bytes, or chunks streamed in order) to `path` atomically, with these mode bits. The temp
    name is unpredictable and created exclusively, so a file or symlink planted there is never written through.
    On any error (or an exception from the chunks' source) the temp file is removed and the error raised.
    `durable` False: no fsync of the file or the folder. Readers still see the old file or the new one whole (the
    rename is atomic); a power cut may lose the write. For files rewritten every few seconds (the heartbeat),
    whose fsyncs on NFS or Lustre cost 10-100 ms each."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARK}{os.getpid()}-")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)  # mkstemp makes it 0600: the caller says who else may read it
            for chunk in (data,) if isinstance(data, bytes | memoryview) else data:
                fh.write(chunk)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_stale_temp(name: str) -> bool:
    """A temp file of write_atomic left by another process (killed while writing): safe to delete where only
    this process writes."""
    return name.startswith(".") and TMP_MARK in name and f"{TMP_MARK}{os.getpid()}-" not in name
