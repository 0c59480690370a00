"""sshd per host, and the client-side files of a cluster (ssh_config, known_hosts, hosts.txt).

Each host's sshd listens on the host's address only, with its own host key and pid file; root logs in
with the cluster's key only. `SetEnv DOCKER_HOST=...` makes every session (and so the docker CLI and
`docker system dial-stdio`, which the Docker SDK runs over SSH) talk to that host's own daemon.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .layout import ClusterState, HostLayout
from .proc import alive, cmdline, in_netns, read_pidfile, run, stop_pids, wait_until

SSHD = "/usr/sbin/sshd"  # sshd must be started by absolute path (it re-executes itself)
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
DEFAULT_DOCKER_SOCK = Path("/var/run/docker.sock").resolve()


def keygen(path: Path, comment: str) -> str:
    """New ed25519 key pair at path (+ .pub); returns the public line."""
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return path.with_name(path.name + ".pub").read_text().strip()


def sshd_config(host: HostLayout, authorized_keys: Path) -> str:
    d = host.ssh_dir
    return "\n".join([
        "Port 22",
        f"ListenAddress {host.addr}",
        f"HostKey {d / 'ssh_host_ed25519_key'}",
        f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "UseDNS no",
        "PrintMotd no",
        f"SetEnv DOCKER_HOST=unix://{host.docker_sock}",
        f"Subsystem sftp {SFTP_SERVER}",
        "",
    ])


def start_sshd(host: HostLayout, authorized_keys: Path) -> str:
    """Write the host's key and config, start sshd in the netns (it daemonizes once its socket is
    bound, so a zero exit means it listens). Returns the host's public key line.

    sshd runs in a mount namespace of its own where the default Docker socket path is the host's own
    socket (a bind mount): the machine's filesystem is shared, and a client that reaches
    /var/run/docker.sock over SSH (e.g. by streamlocal forwarding) must not find the root daemon."""
    d = host.ssh_dir
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    pub = keygen(d / "ssh_host_ed25519_key", host.alias)
    (d / "sshd_config").write_text(sshd_config(host, authorized_keys))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir (Debian)
    sshd_argv = [SSHD, "-f", str(d / "sshd_config"), "-E", str(host.log_dir / "sshd.log")]
    if DEFAULT_DOCKER_SOCK.exists():
        script = 'mount --bind "$0" "$1" && shift && exec "$@"'
        sshd_argv = ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script,
                     str(host.docker_sock), str(DEFAULT_DOCKER_SOCK), *sshd_argv]
    run(in_netns(host.netns, sshd_argv), timeout=15)
    wait_until(lambda: read_pidfile(d / "sshd.pid") is not None, 10, f"sshd of {host.alias}")
    return pub


def rebind_docker_sock(host: HostLayout) -> None:
    """After dockerd made a new socket (start_docker), point sshd's default socket path at it."""
    pid = read_pidfile(host.ssh_dir / "sshd.pid")
    if not (pid and alive(pid) and DEFAULT_DOCKER_SOCK.exists()):
        return
    script = 'umount -l "$1"; mount --bind "$0" "$1"'
    run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "sh", "-c", script,
         str(host.docker_sock), str(DEFAULT_DOCKER_SOCK)], timeout=10)


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
            "  User root",
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
