"""The Docker SDK client tunnelled over a host's SSH connection (orchestrate/remote/docker.py), against a fake
daemon on a socket pair: what its requests carry."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrate.remote.docker import client_over_ssh


class _Channel(socket.socket):
    """One end of a socket pair standing in for a paramiko channel running `docker system dial-stdio`."""

    def exec_command(self, command: str) -> None:
        pass


class _Daemon(http.server.BaseHTTPRequestHandler):
    """Answers every GET as the Docker daemon's /version would, and keeps what each request carried."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, dict(self.headers)))
        body = json.dumps({"ApiVersion": "1.41", "Version": "20.10.24"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Conn:
    """What client_over_ssh uses of a Connection: the host's label and docker_host, and channels."""

    host = SimpleNamespace(label="h0", docker_host=None)

    def open_channel(self) -> _Channel:
        ours, daemons = socket.socketpair()
        threading.Thread(target=_Daemon, args=(daemons, ("h0", 0), None), daemon=True).start()
        return _Channel(ours.family, ours.type, fileno=ours.detach())


def test_the_users_environment_proxies_and_netrc_never_reach_the_docker_api(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's URL is http+docker://ssh whatever the host: requests' environment lookups (done per request,
    27 ms per host in `up`'s profile) would match a proxy or a ~/.netrc entry for a machine named `ssh` and send
    the request through the proxy's form or with those credentials to every node's daemon."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine ssh login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    _Daemon.seen = []
    client = client_over_ssh(_Conn(), timeout=10)  # type: ignore[arg-type]
    client.api.version(api_version=False)
    client.close()
    assert len(_Daemon.seen) == 2
    for path, headers in _Daemon.seen:
        assert path == "/version" and "Authorization" not in headers
