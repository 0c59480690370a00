"""The data fetch script (orchestrate/backends/docker_ssh/data.py's SCRIPT) run here as in a node's container, an archive for it,
and the HTTP servers it downloads from."""

from __future__ import annotations

import hashlib
import http.server
import io
import socketserver
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from orchestrate.backends.docker_ssh import data as prefetch
from orchestrate.backends.docker_ssh.datacopy import BATCHES, MARKER


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def quiet_folder(folder: Path) -> Callable[..., QuietHandler]:
    """A handler serving `folder`'s files without a log line per request."""
    return partial(QuietHandler, directory=str(folder))


@contextmanager
def serving(handler: Callable[..., socketserver.BaseRequestHandler], bind: str = "127.0.0.1") -> Iterator[str]:
    """An HTTP server of `handler` on `bind` (a free port), in a thread until the block ends; yields its base URL."""
    server = http.server.ThreadingHTTPServer((bind, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{bind}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def archive(path: Path, payload: bytes) -> str:
    """A CIFAR-like archive at `path` whose one batch file holds `payload`; returns its md5."""
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"{BATCHES}/data_batch_1")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return hashlib.md5(path.read_bytes()).hexdigest()


def fetch(url: str, md5: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """The fetch script into `data_dir`, the URL in its environment as the node's fetch container has it."""
    argv = [sys.executable, "-c", prefetch.SCRIPT, md5, str(data_dir), prefetch.ARCHIVE, BATCHES,
            MARKER]
    return subprocess.run(argv, env={"DATA_URL": url}, capture_output=True, text=True, timeout=60)
