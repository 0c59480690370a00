"""The fetch script (run here under python, as in the node's container) into a data folder too small for it: a
256 KB tmpfs (needs root, as the suite runs). It fails with exit 6 and one line giving the space needed; nothing
partial is left and nothing is marked verified."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

from orchestrate.apply import data as prefetch


@contextmanager
def small_disk(where: Path) -> Iterator[Path]:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@contextmanager
def served(folder: Path) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def archive(path: Path, payload: bytes) -> str:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"{prefetch.BATCHES}/data_batch_1")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return hashlib.md5(path.read_bytes()).hexdigest()


def fetch(url: str, md5: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", prefetch.SCRIPT, md5, str(data_dir), prefetch.ARCHIVE, prefetch.BATCHES,
            prefetch.MARKER]
    return subprocess.run(argv, env={"DATA_URL": url}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("payload", "what"), [
    (os.urandom(400_000), "the download"),  # incompressible: the archive itself does not fit
    (bytes(1_000_000), "extracting the archive"),  # zeros: a 1 KB archive that expands to 1 MB
])
def test_a_data_folder_too_small_fails_in_one_line_and_leaves_nothing_partial(
        tmp_path: Path, payload: bytes, what: str) -> None:
    (tmp_path / "www").mkdir()
    md5 = archive(tmp_path / "www" / "c.tar.gz", payload)
    with served(tmp_path / "www") as base, small_disk(tmp_path / "data") as data:
        res = fetch(f"{base}/c.tar.gz", md5, data)
        assert res.returncode == 6, res.stdout + res.stderr
        errors = [line for line in res.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: no space left for {what}: it needs ")
        assert "free some space there or choose another data dir" in errors[0]
        left = sorted(p.name for p in data.iterdir())
        assert left == ([] if what == "the download" else [prefetch.ARCHIVE])  # no temp file, folder or marker
