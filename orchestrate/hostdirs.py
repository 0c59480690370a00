"""PURE: which folders on the hosts a job may use as its data, checkpoint and log dirs (bind-mounted read-write into
its containers): never a system folder, never the Docker socket's."""

from __future__ import annotations

import posixpath

# Folders a container must never get as a bind mount: the host's root, its system trees, the Docker socket's
# folder (/run, /var/run) and Docker's data root. A job writes into its dirs, and containers get them read-write.
SYSTEM_DIRS = ("/etc", "/run", "/var/run", "/proc", "/sys", "/dev", "/boot", "/usr", "/bin", "/sbin", "/lib",
               "/var/lib/docker")


def host_dir_problem(path: str) -> str | None:
    """PURE: why `path` cannot be a data/checkpoint/log dir on the hosts (None when it can)."""
    if "\x00" in path or not (path.startswith("/") or path == "~" or path.startswith("~/")):
        return "must be an absolute path on the hosts (or start with ~/ for the login's home there)"
    norm = posixpath.normpath(path)
    if norm == "/" or any(norm == d or norm.startswith(d + "/") for d in SYSTEM_DIRS):
        return ("is a system folder (or under one) that would be mounted into the containers; "
                "choose a folder of your own, e.g. under your home")
    return None


DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"


def socket_exposure(dirs: dict[str, str], docker_host: str | None) -> str | None:
    """PURE: a dir that is the Docker socket's folder or one above it would hand the socket (root on the host)
    to the containers; say which (None when none is). `dirs` as resolved on the host (~ expanded)."""
    socket = docker_host[len("unix://"):] if docker_host and docker_host.startswith("unix://") \
        else DEFAULT_DOCKER_SOCKET
    folder = posixpath.dirname(posixpath.normpath(socket))
    for kind, path in dirs.items():
        norm = posixpath.normpath(path)
        if folder == norm or folder.startswith(norm.rstrip("/") + "/"):
            return (f"{kind} dir {path} holds the Docker socket {socket}, which the containers would get; "
                    "choose a folder beside it, e.g. a subfolder of your home")
    return None
