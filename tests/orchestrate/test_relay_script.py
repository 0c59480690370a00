"""The relay's node-side script (orchestrate/remote/scripts/relay.py), run here for real with this Python: the
server hands its file only to the token's holder and removes it when its stdin closes; a fetch loads only bytes
of the right size and digest, and a relay that breaks off mid-transfer leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from kit.lines import LineReader

from orchestrate.backends.docker_ssh.relay import RELAY_SCRIPT

TOKEN = b"0123456789abcdef"


def _fake_docker(tmp: Path) -> dict[str, str]:
    """A `docker` on PATH whose `load -q` copies its stdin to tmp/loaded (what the daemon would read)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(f'#!/bin/sh\ncat > {tmp}/loaded\n')
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _fetch(port: int, payload: bytes, tmp: Path, token: bytes = TOKEN) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", RELAY_SCRIPT, "fetch", "127.0.0.1", str(port),
                           hashlib.sha256(payload).hexdigest(), str(len(payload)), str(tmp / "in"), "docker", "load", "-q"],
                          input=token.decode() + "\n", capture_output=True, text=True, timeout=60,
                          env=_fake_docker(tmp))


def _serve(served: Path) -> tuple[subprocess.Popen[str], str]:
    """The relay script serving `served`, given the token; its port once it says it."""
    server = subprocess.Popen([sys.executable, "-c", RELAY_SCRIPT, "serve", str(served)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(TOKEN.decode() + "\n")
    server.stdin.flush()
    word, port = LineReader(server.stdout).next(30, "the relay server's port").split()
    assert word == "PORT"
    return server, port


def test_the_server_serves_the_token_holder_and_removes_its_file_when_told_to_end(tmp_path: Path) -> None:
    payload = os.urandom(3 << 20)
    served = tmp_path / "served.tar"
    served.write_bytes(payload)
    server, port = _serve(served)
    try:
        wrong = _fetch(int(port), payload, tmp_path, b"not-the-token")
        assert wrong.returncode == 4 and "got 0 of" in wrong.stderr and not (tmp_path / "loaded").exists()
        assert _fetch(int(port), payload, tmp_path).returncode == 0
        assert (tmp_path / "loaded").read_bytes() == payload and list((tmp_path / "in").iterdir()) == []
    finally:
        server.stdin.close()  # what the orchestrator's closed channel does
        assert server.wait(timeout=30) == 0
    assert not served.exists()


def test_a_relay_that_breaks_off_mid_transfer_leaves_nothing_loaded(tmp_path: Path) -> None:
    payload = os.urandom(1 << 20)
    listener = socket.create_server(("127.0.0.1", 0))

    def half() -> None:  # a relay that dies after half the archive
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            conn.sendall(payload[:len(payload) // 2])

    threading.Thread(target=half, daemon=True).start()
    res = _fetch(listener.getsockname()[1], payload, tmp_path)
    listener.close()
    assert res.returncode == 4 and f"got {len(payload) // 2} of {len(payload)} bytes" in res.stderr
    assert not (tmp_path / "loaded").exists() and list((tmp_path / "in").iterdir()) == []
    refused = _fetch(1, payload, tmp_path)  # nothing listens on port 1
    assert refused.returncode == 3 and "cannot connect to 127.0.0.1:1" in refused.stderr


def test_keep_leaves_the_checked_archive_unlanded_to_serve_on_and_nothing_when_it_does_not_check(tmp_path: Path) -> None:
    payload = os.urandom(1 << 20)
    served = tmp_path / "served.tar"
    served.write_bytes(payload)
    server, port = _serve(served)
    kept = tmp_path / "in" / "image-n5.tar"

    def keep(sha256: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", RELAY_SCRIPT, "keep", "127.0.0.1", port, sha256,
                               str(len(payload)), str(kept)], input=TOKEN.decode() + "\n",
                              capture_output=True, text=True, timeout=60, env=_fake_docker(tmp_path))
    try:
        wrong = keep("0" * 64)
        assert wrong.returncode == 4 and not kept.exists() and list((tmp_path / "in").iterdir()) == []
        assert keep(hashlib.sha256(payload).hexdigest()).returncode == 0
        assert kept.read_bytes() == payload and not (tmp_path / "loaded").exists()  # the orchestrator lands it
        assert [p.name for p in (tmp_path / "in").iterdir()] == [kept.name]  # no temporary file left beside it
    finally:
        server.stdin.close()
        assert server.wait(timeout=30) == 0
