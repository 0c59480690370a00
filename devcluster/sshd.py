"""sshd per host, and the client-side files of a cluster (ssh_config, known_hosts, hosts.txt).

Each host's sshd runs with OpenSSH's defaults as Debian ships them: only what makes it one host's
daemon is set (ListenAddress, HostKey, PidFile), plus Debian's `Subsystem sftp` line unless the host
is a no-SFTP variant. So the stock limits hold (10 channels per connection, 10 unauthenticated
connections at once), keys come from
~/.ssh/authorized_keys in the (per-host) home, and root logs in by key only if its own
authorized_keys has the key (the root-login variant). It runs in the host's network and mount
namespaces (hostfs), so a session sees the host's own /home, /tmp, ... and /var/run/docker.sock is the
host's own daemon, root:docker 0660 as dockerd makes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .hostfs import in_host
from .layout import ClusterState, HostLayout
from .proc import alive, cmdline, read_pidfile, run, stop_pids, wait_until

SSHD = "/usr/sbin/sshd"  # sshd must be started by absolute path (it re-executes itself)
SFTP_SERVER = "/usr/lib/openssh/sftp-server"  # Debian's sshd_config: `Subsystem sftp /usr/lib/openssh/sftp-server`


def keygen(path: Path, comment: str) -> str:
    """New ed25519 key pair at path (+ .pub); returns the public line."""
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return path.with_name(path.name + ".pub").read_text().strip()


def sshd_config(host: HostLayout, sftp: bool = True) -> str:
    d = host.ssh_dir
    lines = [f"ListenAddress {host.addr}", f"HostKey {d / 'ssh_host_ed25519_key'}", f"PidFile {d / 'sshd.pid'}"]
    if sftp:
        lines.append(f"Subsystem sftp {SFTP_SERVER}")
    return "\n".join(lines) + "\n"


def start_sshd(host: HostLayout, sftp: bool = True) -> str:
    """Write the host's key and config, start sshd in the host's namespaces (it daemonizes once its
    socket is bound, so a zero exit means it listens). Returns the host's public key line."""
    d = host.ssh_dir
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    pub = keygen(d / "ssh_host_ed25519_key", host.alias)
    (d / "sshd_config").write_text(sshd_config(host, sftp))
    run_sshd(host)
    return pub


def run_sshd(host: HostLayout) -> None:
    """Start sshd with the host's key and config as they are (also after a reboot: the key stays)."""
    d = host.ssh_dir
    run(in_host(host, [SSHD, "-f", str(d / "sshd_config"), "-E", str(host.log_dir / "sshd.log")]), timeout=15)
    wait_until(lambda: read_pidfile(d / "sshd.pid") is not None, 10, f"sshd of {host.alias}")


def stop_sshd(host: HostLayout) -> None:
    pid = read_pidfile(host.ssh_dir / "sshd.pid")
    if pid and alive(pid) and str(host.ssh_dir) in cmdline(pid):
        stop_pids([pid], grace=3)


def ssh_config(state: ClusterState, key: Path, known_hosts: Path) -> str:
    blocks = []
    for h in state.hosts():
        blocks.append("\n".join([
            f"Host {h.alias}",
            f"  HostName {h.addr}",
            f"  User {state.user}",
            "  Port 22",
            f"  IdentityFile {key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {known_hosts}",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "  ConnectTimeout 5",
            "",
        ]))
    return "\n".join(blocks)


def known_hosts(state: ClusterState, host_keys: dict[int, str]) -> str:
    """One line per host, by alias and address (port 22, so no [addr]:port form)."""
    lines = []
    for h in state.hosts():
        kind, blob = host_keys[h.index].split()[:2]
        lines.append(f"{h.alias},{h.addr} {kind} {blob}")
    return "\n".join(lines) + "\n"


def write_client_files(state: ClusterState, host_keys: dict[int, str]) -> None:
    """ssh_config, known_hosts, hosts.txt in the state folder, and home/.ssh/ with the same config,
    known_hosts and key (as id_ed25519): paramiko (and docker-py's SSH adapter) read ~/.ssh from $HOME, so a process
    started with HOME=<state>/home resolves the aliases and verifies host keys strictly."""
    d = state.dir
    key, kh = d / "id_ed25519", d / "known_hosts"
    kh.write_text(known_hosts(state, host_keys))
    (d / "ssh_config").write_text(ssh_config(state, key, kh))
    (d / "hosts.txt").write_text("".join(f"{h.alias} slots=1\n" for h in state.hosts()))
    home_ssh = d / "home" / ".ssh"
    home_ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy(d / "ssh_config", home_ssh / "config")
    shutil.copy(kh, home_ssh / "known_hosts")
    # paramiko's default key: used when a client names a host by address (no Host entry matches)
    shutil.copy(key, home_ssh / "id_ed25519")
    shutil.copy(d / "id_ed25519.pub", home_ssh / "id_ed25519.pub")
