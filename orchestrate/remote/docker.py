"""Docker SDK clients tunnelled over each host's one SSH connection, containers by label.

docker-py's own ssh:// adapter opens a second SSH connection and ignores the ssh config's Port for aliases.
Here the SDK gets HTTP connections whose socket is a paramiko channel running `docker system dial-stdio` on
the host (with DOCKER_HOST set when the hosts file gives docker_host=), over the connection we already hold.
"""

from __future__ import annotations

import logging
from typing import Any

import docker
import docker.errors
import paramiko
import urllib3
import urllib3.connection
import urllib3.connectionpool
from docker.transport.sshconn import SSHHTTPAdapter

from orchestrate.errors import SSHError
from orchestrate.labels import JOB_LABEL
from orchestrate.remote.ssh import Connection, quote_command

log = logging.getLogger(__name__)
API_VERSION_MIN = "1.41"


class _ChannelConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection whose socket is `docker system dial-stdio` on a paramiko channel."""

    def __init__(self, conn: Connection, command: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._ssh = conn
        self._command = command
        self._timeout = timeout

    def connect(self) -> None:
        chan: paramiko.Channel = self._ssh.open_channel()
        chan.settimeout(self._timeout)
        chan.exec_command(self._command)
        self.sock = chan


class _ChannelPool(urllib3.connectionpool.HTTPConnectionPool):
    scheme = "ssh"

    def __init__(self, conn: Connection, command: str, timeout: float | None, maxsize: int) -> None:
        super().__init__("localhost", timeout=timeout, maxsize=maxsize)
        self._ssh = conn
        self._command = command
        self._chan_timeout = timeout

    def _new_conn(self) -> _ChannelConnection:
        return _ChannelConnection(self._ssh, self._command, self._chan_timeout)


class _TunnelAdapter(SSHHTTPAdapter):
    """docker-py's SSH adapter, reusing its pool bookkeeping, with our connection instead of its own."""

    def __init__(self, conn: Connection, command: str, timeout: float | None, max_pool_size: int = 8) -> None:
        # Deliberately not calling SSHHTTPAdapter.__init__: it would open its own paramiko connection.
        self.ssh_client = None
        self.ssh_host = conn.host.label
        self.timeout = timeout  # type: ignore[assignment]  # the stubs say int; requests takes a float
        self.max_pool_size = max_pool_size
        self._conn = conn
        self._command = command
        self.pools = urllib3._collections.RecentlyUsedContainer(4, dispose_func=lambda p: p.close())  # type: ignore[assignment]
        super(SSHHTTPAdapter, self).__init__()

    def get_connection(self, url: Any, proxies: Any = None) -> Any:
        # One pool per client, whatever the URL: keyed by URL (docker-py's way) each API path kept its own idle
        # channel, up to 4 per client, which overran sshd's stock MaxSessions of 10 with 3 clients per host.
        pools: Any = self.pools
        with pools.lock:
            pool = pools.get("tunnel")
            if pool is None:
                pool = _ChannelPool(self._conn, self._command, self.timeout, self.max_pool_size)
                pools["tunnel"] = pool
            return pool

    def close(self) -> None:
        super(SSHHTTPAdapter, self).close()


def dial_command(docker_host: str | None) -> str:
    env = {"DOCKER_HOST": docker_host} if docker_host else None
    return quote_command(["docker", "system", "dial-stdio"], env)


def client_over_ssh(conn: Connection, timeout: float | None = 60.0) -> docker.DockerClient:
    """A DockerClient talking to the host's daemon through `conn`. Raises SSHError if the daemon is absent."""
    api = docker.APIClient(base_url="tcp://127.0.0.1:1", version=API_VERSION_MIN,
                           timeout=timeout)  # type: ignore[arg-type]  # None: no timeout (log followers)
    adapter = _TunnelAdapter(conn, dial_command(conn.host.docker_host), timeout)
    # The URL is http+docker://ssh on every host: the user's proxy variables (ALL_PROXY matches any scheme) would
    # put the request in a proxy's absolute form and a ~/.netrc entry for `ssh` would add its credentials; and
    # requests scans the environment for them on every request (27 ms a host in `up`'s profile).
    api.trust_env = False
    api.mount("http+docker://ssh", adapter)
    api._unmount("http://", "https://")  # type: ignore[attr-defined]
    api.base_url = "http+docker://ssh"
    try:
        server = api.version(api_version=False)
        api._version = server["ApiVersion"]  # type: ignore[attr-defined]
    except Exception as err:
        raise SSHError(f"{conn.host.label}: cannot reach the Docker daemon over SSH "
                       f"({_docker_problem(conn)}); install Docker or set docker_host= in the hosts file") from err
    client = docker.DockerClient.__new__(docker.DockerClient)
    client.api = api
    client.server_version = str(server.get("Version", "?"))  # type: ignore[attr-defined]  # saves a round trip
    return client


def _docker_problem(conn: Connection) -> str:
    """Say why `docker` failed on a host, in a few words."""
    try:
        res = conn.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=20,
                       env={"DOCKER_HOST": conn.host.docker_host} if conn.host.docker_host else None)
    except SSHError as err:
        return str(err)
    if res.rc == 127:
        return "docker: command not found"
    return (res.err.strip() or res.out.strip() or f"exit {res.rc}").splitlines()[-1]


def image_id(client: docker.DockerClient, name: str) -> str | None:
    try:
        return str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return None


def job_containers(client: docker.DockerClient, job: str) -> list[Any]:
    """Containers that carry the job's label (running or not). Nothing else is ever touched."""
    found = client.containers.list(all=True, filters={"label": f"{JOB_LABEL}={job}"}, ignore_removed=True)
    return [c for c in found if c.labels.get(JOB_LABEL) == job]
