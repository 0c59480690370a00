"""SSH with paramiko: one connection per host, host keys verified, commands quoted, opened in parallel.

Every argument sent to a host is shlex-quoted (sshd always hands the command to the user's shell, so quoting
is what keeps host names, paths and values from running anything). Connections open through the fan-out
(orchestrate/fanout.py), which collects every host's failure into one MultiHostError.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import paramiko

from orchestrate.errors import HostKeyError, MultiHostError, SSHError
from orchestrate.fanout import fan_out
from orchestrate.hosts import Host
from orchestrate.remote import scripts
from orchestrate.remote.identity import Identity

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5
_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


def quote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """One command line for the remote shell: every word quoted, env assignments as a quoted prefix."""
    words = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    words += [shlex.quote(str(a)) for a in argv]
    return " ".join(words)


def known_hosts_files(host: Host) -> list[str]:
    return list(host.known_hosts_files) or [os.path.expanduser("~/.ssh/known_hosts")]


def host_key_name(host: Host) -> str:
    return host.hostname if host.port == 22 else f"[{host.hostname}]:{host.port}"


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def find_known_host_line(files: Sequence[str], name: str) -> tuple[str, int] | None:
    """The known_hosts file and line number that hold a key for `name` (plain or hashed entries)."""
    for path in files:
        try:
            lines = open(path).read().splitlines()  # noqa: SIM115 - small file read at once
        except OSError:
            continue
        for number, line in enumerate(lines, start=1):
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number) if line.strip() else None
            if entry is None:
                continue
            for pattern in entry.hostnames:
                if pattern == name or (
                    pattern.startswith("|1|") and paramiko.HostKeys.hash_host(name, pattern) == pattern
                ):
                    return path, number
    return None


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Refuse an unknown key with a message that says how to trust it."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        target = known_hosts_files(self.host)[0]
        port = f"-p {self.host.port} " if self.host.port != 22 else ""
        raise HostKeyError(
            f"host key of {self.host.label} ({key.get_name()} {fingerprint(key)}) is unknown: not in {target}; "
            f"check it and trust it with 'ssh-keyscan {port}{self.host.hostname} >> {target}' "
            "or pass --accept-new-host-keys"
        )


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust on first use: add the new key to the user's known_hosts file (a changed key is still refused)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        target = known_hosts_files(self.host)[0]
        line = f"{host_key_name(self.host)} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(target, "a") as fh:
                fh.write(line)
        log.warning("added host key of %s (%s) to %s", self.host.label, fingerprint(key), target)


# OpenSSH's stock MaxSessions is 10 channels per connection. We stay below it on each connection and open another
# connection to the same host when a connection is full or the server refuses a channel anyway (another client
# of ours, or a site with a lower limit): a refused channel is a resource limit, never an unreachable host.
CHANNELS_PER_CONNECTION = 8
MAX_CONNECTIONS_PER_HOST = 4

# Files are read and written through exec channels: it works on hosts without the SFTP subsystem (hardened sites
# remove it) and is one code path everywhere. Paths arrive as positional arguments.
WRITE_SCRIPT = scripts.text("write.sh")
IDENTITY_SCRIPT = scripts.text("identity.sh")


class ChannelLimitError(SSHError):
    """Every connection to the host refused another channel: a resource limit, the host itself answers."""


class Connection:
    """The SSH connections to one host, reused for every phase (commands, file transfers, the Docker tunnel).

    Usually one connection; more only when channels run past what one connection may hold (see above)."""

    def __init__(self, host: Host, client: paramiko.SSHClient, accept_new_host_keys: bool = False) -> None:
        self.host = host
        self.client = client
        self._accept_new = accept_new_host_keys
        self._clients = [client]
        self._lock = threading.Lock()
        self._identity: Identity | None = None
        self.peak_channels = 0  # the most channels this process held on the host at once (all connections)

    @classmethod
    def open(cls, host: Host, accept_new_host_keys: bool = False, timeout: float = CONNECT_TIMEOUT) -> Connection:
        return cls(host, _connect(host, accept_new_host_keys, timeout), accept_new_host_keys)

    @property
    def transport(self) -> paramiko.Transport:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise SSHError(f"connection to {self.host.label} is closed")
        return transport

    @property
    def dropped(self) -> bool:
        """The main connection has ended (the next channel will connect again, see _revive)."""
        transport = self.client.get_transport()
        return transport is None or not transport.is_active()

    @property
    def peer_address(self) -> str:
        return str(self.transport.getpeername()[0])

    def open_channel(self, timeout: float = CONNECT_TIMEOUT) -> paramiko.Channel:
        """A session channel on a connection with room; another connection when all are full or refuse. A channel
        refused because the main connection ended while it was being opened (the drop landing between the check
        and the open) is opened once more on a new connection: the host may well answer."""
        try:
            return self._open_channel(timeout)
        except SSHError:
            if not self.dropped:
                raise
            return self._open_channel(timeout)

    def _open_channel(self, timeout: float) -> paramiko.Channel:
        with self._lock:
            self._revive()
            refused = 0
            for client in list(self._clients):
                transport = client.get_transport()
                if transport is None or not transport.is_active() or _open_count(transport) >= CHANNELS_PER_CONNECTION:
                    continue
                chan = self._try_open(transport, timeout)
                if chan is not None:
                    return self._counted(chan)
                refused += 1
            if len(self._clients) >= MAX_CONNECTIONS_PER_HOST:
                raise ChannelLimitError(f"{self.host.label}: sshd refused another channel on all "
                                        f"{len(self._clients)} connections (MaxSessions); the host answers, but "
                                        "fewer parallel operations are needed")
            log.debug("%s: opening connection %d (%d refused channels)", self.host.label, len(self._clients) + 1,
                      refused)
            extra = _connect(self.host, self._accept_new, CONNECT_TIMEOUT)
            self._clients.append(extra)
            chan = self._try_open(extra.get_transport(), timeout)  # type: ignore[arg-type]
            if chan is None:
                raise ChannelLimitError(f"{self.host.label}: sshd refuses every session channel on a new connection; "
                                        "check MaxSessions in its sshd_config")
            return self._counted(chan)

    def _revive(self) -> None:
        """Connect again when the main connection was dropped while the host may still answer (a reset by a
        firewall or NAT, a killed sshd session): a job must not be declared lost, nor a kill refused, because
        one TCP connection ended. A host that does not answer raises SSHError naming it (caller holds the lock)."""
        if not self.dropped:
            return
        log.warning("%s: the SSH connection was dropped; connecting again", self.host.label)
        self._clients = [c for c in self._clients if c is not self.client]
        self.client.close()
        self.client = _connect(self.host, self._accept_new, CONNECT_TIMEOUT)
        self._clients.insert(0, self.client)

    def _try_open(self, transport: paramiko.Transport, timeout: float) -> paramiko.Channel | None:
        try:
            return transport.open_session(timeout=timeout)
        except paramiko.ChannelException:  # the server said no: MaxSessions, not a dead host
            return None
        except (paramiko.SSHException, OSError, EOFError) as err:
            raise SSHError(f"{self.host.label} unreachable: cannot open an SSH channel ({err or 'timeout'})") from None

    def _counted(self, chan: paramiko.Channel) -> paramiko.Channel:
        held = sum(_open_count(t) for t in (c.get_transport() for c in self._clients) if t is not None)
        self.peak_channels = max(self.peak_channels, held)
        return chan

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0,
            check: bool = False, stdin: bytes | None = None) -> Result:
        """Run one command (every word quoted); return its exit code and output. Bounded by `timeout`."""
        chunks = None if stdin is None else iter((stdin,))
        return self.run_streaming(argv, chunks, env=env, timeout=timeout, check=check)

    def run_streaming(self, argv: Sequence[str], chunks: Iterator[bytes] | None, env: Mapping[str, str] | None = None,
                      timeout: float = 60.0, check: bool = False) -> Result:
        """Like run, with standard input fed from `chunks` as they come (large files never sit in memory)."""
        command = quote_command(argv, env)
        chan = self.open_channel()
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            for block in chunks or ():
                chan.sendall(block)
            chan.shutdown_write()
            out, err = _drain(chan, time.monotonic() + timeout, self.host.label, argv[0])
            rc = chan.recv_exit_status()
        except TimeoutError:
            raise SSHError(f"{self.host.label}: {argv[0]} did not finish within {timeout:.0f} s "
                           "(host unreachable or overloaded?)") from None
        finally:
            chan.close()
        result = Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and rc != 0:
            last = (result.err.strip() or result.out.strip()).splitlines()[-1:] or ["no output"]
            raise SSHError(f"{self.host.label}: {' '.join(argv[:2])} failed (exit {rc}): {last[0]}")
        return result

    def identity(self) -> Identity:
        """uid, gid, name and home of the login on this host (asked once)."""
        if self._identity is None:
            res = self.run(["sh", "-c", IDENTITY_SCRIPT], timeout=30, check=True)
            uid, gid, name, home = (res.out.splitlines() + ["", "", "", ""])[:4]
            try:
                self._identity = Identity(int(uid), int(gid), name, home.rstrip("/") or "/")
            except ValueError:
                raise SSHError(f"{self.host.label}: cannot tell the login's uid/gid (id printed {res.out!r})") from None
        return self._identity

    def read_file(self, path: str, timeout: float = 60.0) -> bytes:
        """A file's bytes; FileNotFoundError when it cannot be read (missing, not a file, no permission)."""
        chan = self.open_channel()
        try:
            chan.settimeout(timeout)
            chan.exec_command(quote_command(["cat", "--", path]))
            chan.shutdown_write()
            out, _ = _drain(chan, time.monotonic() + timeout, self.host.label, "cat")
            rc = chan.recv_exit_status()
        except TimeoutError:
            raise SSHError(f"{self.host.label}: reading {path} did not finish within {timeout:.0f} s") from None
        finally:
            chan.close()
        if rc != 0:
            raise FileNotFoundError(f"{self.host.label}:{path}")
        return out

    def stream_file(self, path: str, timeout: float = 3600.0) -> Iterator[bytes]:
        """A file's bytes in blocks, as they arrive (for copies between hosts); SSHError if it cannot be read."""
        chan = self.open_channel()
        try:
            chan.settimeout(timeout)
            chan.exec_command(quote_command(["cat", "--", path]))
            chan.shutdown_write()
            while block := chan.recv(1 << 20):
                yield block
            if chan.recv_exit_status() != 0:
                raise SSHError(f"{self.host.label}: cannot read {path}")
        finally:
            chan.close()

    def list_dir(self, path: str) -> list[str]:
        """Names in a folder ([] when it does not exist or cannot be read)."""
        res = self.run(["ls", "-1A", "--", path], timeout=30)
        return res.out.splitlines() if res.rc == 0 else []

    def write_file(self, path: str, chunks: Iterator[bytes], timeout: float = 3600.0) -> None:
        """Stream `chunks` into `path` atomically (temporary name, then rename); SSHError on failure."""
        res = self.run_streaming(["sh", "-c", WRITE_SCRIPT, "write", path], chunks, timeout=timeout)
        if res.rc != 0:
            why = (res.err.strip().splitlines() or ["no output"])[-1]
            raise SSHError(f"{self.host.label}: cannot write {path}: {why}")

    def close(self) -> None:
        for client in self._clients:
            client.close()


def _open_count(transport: paramiko.Transport) -> int:
    """Open channels on one connection (paramiko keeps no public count)."""
    channels: dict[int, paramiko.Channel] = transport._channels  # type: ignore[attr-defined]
    return sum(1 for chan in list(channels.values()) if not chan.closed)


def _no_connection(host: Host, err: paramiko.ssh_exception.NoValidConnectionsError) -> SSHError:
    """paramiko's error for every address failing: refused only where each was refused; otherwise the host is not
    reached at all (no route: its link is down, or it is off), which "is sshd running?" would misname."""
    causes = [e for e in err.errors.values() if isinstance(e, OSError)]
    if causes and all(e.errno == errno.ECONNREFUSED for e in causes):
        return SSHError(f"connection to {host.label} ({host.hostname}:{host.port}) refused; is sshd running on that port?")
    why = "; ".join(sorted({e.strerror or str(e) for e in causes})) or str(err)
    return SSHError(f"cannot reach {host.label} ({host.hostname}:{host.port}): {why}; is the host up and on the network?")


def _connect(host: Host, accept_new_host_keys: bool, timeout: float) -> paramiko.SSHClient:
    """One authenticated SSH connection, host key verified; every failure as one SSHError naming the host."""
    client = paramiko.SSHClient()
    for path in known_hosts_files(host):
        if os.path.exists(path):
            client.load_host_keys(path)
    client.set_missing_host_key_policy(_AcceptNew(host) if accept_new_host_keys else _RejectUnknown(host))
    try:
        client.connect(
            host.hostname, port=host.port, username=host.user, key_filename=list(host.key_filenames) or None,  # type: ignore[arg-type]  # paramiko takes a list too
            timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
            look_for_keys=not host.identities_only, allow_agent=not host.identities_only,
        )
    except HostKeyError:
        raise
    except paramiko.BadHostKeyException as err:
        where = find_known_host_line(known_hosts_files(host), host_key_name(host))
        at = f"{where[0]}:{where[1]}" if where else " or ".join(known_hosts_files(host))
        raise HostKeyError(
            f"host key of {host.label} CHANGED (now {err.key.get_name()} {fingerprint(err.key)}), refusing to "
            f"connect; if the host was really reinstalled, remove the old key at {at} "
            f"(ssh-keygen -R {shlex.quote(host_key_name(host))}) and connect again"
        ) from None
    except paramiko.AuthenticationException:
        keys = ", ".join(host.key_filenames) or "the default keys and agent"
        raise SSHError(f"cannot log in to {host.label} as {host.user or os.environ.get('USER', '?')} with "
                       f"{keys}: authentication failed; check User/IdentityFile in the ssh config") from None
    except socket.gaierror:
        raise SSHError(f"host name {host.hostname!r} of {host.label} does not resolve; check the hosts file "
                       "and HostName in the ssh config") from None
    except TimeoutError:
        raise SSHError(f"connecting to {host.label} ({host.hostname}:{host.port}) timed out after "
                       f"{timeout:.0f} s; is the host up and the port right?") from None
    except paramiko.ssh_exception.NoValidConnectionsError as err:
        raise _no_connection(host, err) from None
    except ConnectionRefusedError:
        raise SSHError(f"connection to {host.label} ({host.hostname}:{host.port}) refused; is sshd running "
                       "on that port?") from None
    except (OSError, paramiko.SSHException) as err:
        raise SSHError(f"cannot connect to {host.label} ({host.hostname}:{host.port}): {err}") from None
    transport = client.get_transport()
    assert transport is not None
    # Keepalives keep NAT/firewall state fresh; dead links are caught by the timeouts on every channel.
    transport.set_keepalive(KEEPALIVE_S)
    return client


def _drain(chan: paramiko.Channel, deadline: float, label: str, what: str) -> tuple[bytes, bytes]:
    """All of stdout and stderr, until the end of the channel's data (EOF), not until the exit status: OpenSSH
    may send the exit status before the last output (a short command's last line was lost that way)."""
    out, err = bytearray(), bytearray()
    while True:
        got = False
        if chan.recv_ready():
            out += chan.recv(65536)
            got = True
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
            got = True
        if not got:
            ended = chan.eof_received or chan.closed
            if ended and not chan.recv_ready() and not chan.recv_stderr_ready():
                return bytes(out), bytes(err)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: {what}")
            time.sleep(0.01)


def connect_all(hosts: Sequence[Host], accept_new_host_keys: bool = False) -> list[Connection]:
    """One connection per host, opened in parallel; every failing host is reported."""
    conns: list[Connection | None] = [None] * len(hosts)

    def one(index: int) -> Connection:
        conns[index] = Connection.open(hosts[index], accept_new_host_keys)
        return conns[index]  # type: ignore[return-value]

    try:
        return fan_out("ssh", list(range(len(hosts))), one, lambda i: hosts[i].label)
    except MultiHostError:
        for conn in conns:
            if conn is not None:
                conn.close()
        raise
