"""What makes a host's files its own: the login account, and a mount namespace per host.

A real machine has its own /home, /root, /tmp, /var/tmp, /mnt and /run. Every simulated host shares
this machine's filesystem, so each one gets a mount namespace (kept alive by an nsfs bind under the
cluster's `ns/` folder) in which those paths are binds of folders under `<host>/fs/`. sshd,
containerd and dockerd of the host all run in it, so a path a user names over SSH and a bind mount a
container gets resolve alike, as on a real machine. The namespace is a slave of the machine's: mounts
made inside it (dockerd's overlays) stay inside it and go with it.

The login account is one account of the machine (/etc/passwd is shared, as with LDAP on a real
cluster): made once with useradd, in the `docker` group, and kept after teardown (other clusters of
other test sessions may be using it; it owns nothing outside the clusters' folders).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import uuid
from pathlib import Path, PurePosixPath

from .errors import DevclusterError
from .layout import ClusterState, HostLayout, state_lock
from .proc import run

LOGIN_USER = "ddp"
DOCKER_GROUP = "docker"
# path on the host -> (folder under <host>/fs/, mode); the order is the order of the binds
TOOLS = ("useradd", "usermod", "setpriv", "mount")
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PER_HOST = {"/home": ("home", 0o755), "/root": ("root", 0o700), "/tmp": ("tmp", 0o1777),
            "/var/tmp": ("var-tmp", 0o1777), "/mnt": ("mnt", 0o755), "/run": ("run", 0o755),
            # where `up --gpus N` puts the simulated nvidia-smi: a folder on sshd's default PATH
            # (/usr/local/bin:/usr/bin:/bin:/usr/games) that is empty on the machine, so each host has its own
            "/usr/games": ("games", 0o755)}


def ensure_user(name: str = LOGIN_USER) -> pwd.struct_passwd:
    """The login account, made if missing (idempotent, under the state lock): home /home/NAME (each
    host has its own /home), shell bash, member of docker, password field `*` (no password; `!` would
    read as a locked account and sshd without PAM refuses those)."""
    if name == "root":
        return pwd.getpwnam("root")
    with state_lock():
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            run(["useradd", "--no-create-home", "--home-dir", f"/home/{name}", "--shell", "/bin/bash",
                 "--user-group", "--groups", DOCKER_GROUP, "--password", "*", name], timeout=30)
            return pwd.getpwnam(name)
        if name not in _group_members(DOCKER_GROUP):
            run(["usermod", "--append", "--groups", DOCKER_GROUP, name], timeout=30)
        return entry


def _group_members(group: str) -> list[str]:
    try:
        return list(grp.getgrnam(group).gr_mem)
    except KeyError as e:
        raise DevclusterError(f"no `{group}` group: install docker.io (it makes the group)") from e


def home_of(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def make_host_dirs(state: ClusterState, host: HostLayout, authorized_key: str) -> None:
    """<host>/fs/: the per-host folders, the login user's home with the cluster's key in
    ~/.ssh/authorized_keys (OpenSSH's default AuthorizedKeysFile), and sshd's privsep dir in /run."""
    for sub, mode in PER_HOST.values():
        d = host.fs_dir / sub
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(mode)
    (host.fs_dir / "run" / "sshd").mkdir(mode=0o755, exist_ok=True)
    entry = pwd.getpwnam(state.user)
    home = path_on_machine(state, host, home_of(state.user))
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh / "authorized_keys").write_text(authorized_key + "\n")
    for p in (home, ssh, ssh / "authorized_keys"):
        os.chown(p, entry.pw_uid, entry.pw_gid)
    (ssh / "authorized_keys").chmod(0o600)
    if state.shared:
        mountpoint = path_on_machine(state, host, state.shared, shared=False)
        if mountpoint.is_relative_to(host.fs_dir):
            mountpoint.mkdir(parents=True, exist_ok=True)


def check_shared(path: str) -> None:
    """The shared folder's mount point: under a per-host folder (made in each host's copy), or a
    folder the machine has (never made on the machine: that would outlive the cluster)."""
    p = PurePosixPath(path)
    if not p.is_absolute() or p == PurePosixPath("/"):
        raise DevclusterError(f"shared path {path!r}: give an absolute path, e.g. /mnt/shared")
    if p in (PurePosixPath(top) for top in PER_HOST):
        raise DevclusterError(f"shared path {path}: that is a per-host folder; choose a folder in it, e.g. {p}/shared")
    if not any(p.is_relative_to(top) for top in PER_HOST) and not Path(p).is_dir():
        raise DevclusterError(f"shared path {path}: choose a path under one of {', '.join(PER_HOST)} "
                              f"or a folder this machine has")


def path_on_machine(state: ClusterState, host: HostLayout, path: str, *, shared: bool = True) -> Path:
    """Where a path as the host sees it lies on this machine: under <host>/fs/ for the per-host
    folders, under <cluster>/shared/ for the shared folder, else the machine's own path."""
    p = PurePosixPath(path)
    if not p.is_absolute():
        raise DevclusterError(f"{path}: give an absolute path as the host sees it")
    if shared and state.shared and p.is_relative_to(state.shared):
        return state.shared_dir / p.relative_to(state.shared)
    for top, (sub, _) in PER_HOST.items():
        if p.is_relative_to(top):
            return host.fs_dir / sub / p.relative_to(top)
    return Path(p)


def make_shared_dir(state: ClusterState) -> None:
    if state.shared:
        state.shared_dir.mkdir(mode=0o755, exist_ok=True)
        entry = pwd.getpwnam(state.user)
        os.chown(state.shared_dir, entry.pw_uid, entry.pw_gid)


def prepare_ns_dir(state: ClusterState) -> None:
    """unshare --mount=FILE needs FILE on a mount that is not shared: bind ns/ onto itself, private."""
    state.ns_dir.mkdir(mode=0o700, exist_ok=True)
    run(["mount", "--bind", str(state.ns_dir), str(state.ns_dir)], timeout=10)
    run(["mount", "--make-private", str(state.ns_dir)], timeout=10)


def make_mount_ns(state: ClusterState, host: HostLayout) -> None:
    """The host's mount namespace, with the per-host binds and the shared folder in it."""
    host.mntns.touch()
    run(["unshare", f"--mount={host.mntns}", "--propagation", "slave", "true"], timeout=10)
    binds = [(str(host.fs_dir / sub), top) for top, (sub, _) in PER_HOST.items()]
    new_boot_id(host)
    binds.append((str(host.boot_id), BOOT_ID))
    if state.shared:
        binds.append((str(state.shared_dir), state.shared))
    script = " && ".join(f'mount --bind "${{{i * 2 + 1}}}" "${{{i * 2 + 2}}}"' for i in range(len(binds)))
    args = [a for pair in binds for a in pair]
    run(["nsenter", f"--mount={host.mntns}", "--", "sh", "-c", script, "sh", *args], timeout=10)
    # sshd and dockerd start only in a namespace whose /run is the host's: never the machine's /run
    marker = host.fs_dir / "run" / ".devcluster-host"
    marker.write_text(host.alias)
    seen = run(["nsenter", f"--mount={host.mntns}", "--", "cat", "/run/.devcluster-host"], check=False, timeout=10)
    if seen.stdout != host.alias:
        raise DevclusterError(f"{host.alias}: its mount namespace does not show its own /run")


def new_boot_id(host: HostLayout) -> None:
    """A fresh boot id, written in place: the bind over /proc/sys/kernel/random/boot_id shows it at once."""
    with open(host.boot_id, "w") as f:
        f.write(f"{uuid.uuid4()}\n")


def in_host(host: HostLayout, argv: list[str]) -> list[str]:
    """argv run inside the host's network and mount namespaces (as root). nsenter, not `ip netns
    exec`: the latter remounts /sys and hides the cgroup mounts, and dockerd then refuses to start."""
    return ["nsenter", f"--net=/var/run/netns/{host.netns}", f"--mount={host.mntns}", "--", *argv]


def as_user(user: str, argv: list[str]) -> list[str]:
    """argv run as user with its groups (docker among them) and a login-like environment (root: as is)."""
    if user == "root":
        return argv
    entry = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--",
            "env", "-i", f"HOME={entry.pw_dir}", f"USER={user}", f"LOGNAME={user}",
            "PATH=/usr/local/bin:/usr/bin:/bin", *argv]


def install_fake_gpus(host: HostLayout, count: int) -> None:
    """The simulated nvidia-smi (devcluster/scripts/nvidia-smi) in the host's own /usr/games, reporting `count`
    GPUs; the host's index makes its GPU UUIDs its own."""
    games = host.fs_dir / PER_HOST["/usr/games"][0]
    shutil.copy(Path(__file__).with_name("scripts") / "nvidia-smi", games / "nvidia-smi")
    (games / "nvidia-smi").chmod(0o755)
    (games / "gpus").write_text(f"{count} {host.index}\n")
