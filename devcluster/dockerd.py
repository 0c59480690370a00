"""containerd + dockerd per host, started inside the host's netns and mount namespace (hostfs).

Each host gets its own containerd (not dockerd's supervised one): dockerd 20.10 uses the system
containerd whenever /run/containerd/containerd.sock exists, and then the shims, and every
`--network=host` container, would live in the root namespace instead of the host's. Started with
`nsenter --net --mount` (exec, so the Popen pid is the daemon's pid), they and their shims and containers
stay in the host's netns; a `--network=host` container therefore sees the host's own address.
"""

from __future__ import annotations

import json
import logging
from contextlib import closing
from pathlib import Path

import docker

from .errors import StartError
from .hostfs import in_host
from .layout import HostLayout
from .proc import (
    alive,
    cmdline,
    pids_matching,
    read_pidfile,
    run,
    socket_answers,
    spawn,
    stop_pids,
    wait_until,
)

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0


def containerd_toml(host: HostLayout) -> str:
    return "\n".join([
        "version = 2",
        f'root = "{host.containerd_root}"',
        f'state = "{host.containerd_state}"',
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
        "[grpc]",
        f'  address = "{host.containerd_sock}"',
        "[ttrpc]",
        f'  address = "{host.containerd_sock}.ttrpc"',
        "[debug]",
        '  address = ""',
        "[metrics]",
        '  address = ""',
        "",
    ])


def daemon_json(host: HostLayout) -> str:
    """Settings that keep this dockerd apart from the root one. deprecated-key-path: dockerd 20.10
    takes its engine ID from /etc/docker/key.json unless told otherwise; a key of its own gives each
    host a distinct ID in `docker info`, as on distinct machines."""
    # insecure-registries: the test network's plain-HTTP registry (tests/cluster/test_image_pull.py) on the
    # gateway, as a site's own registry is declared on real hosts.
    subnet = host.addr.rsplit(".", 1)[0] + ".0/24"
    return json.dumps({"deprecated-key-path": str(host.dir / "key.json"), "insecure-registries": [subnet]},
                      indent=2)


def dockerd_argv(host: HostLayout) -> list[str]:
    return [
        "dockerd",
        f"--config-file={host.dir / 'daemon.json'}",
        f"--data-root={host.data_root}",
        f"--exec-root={host.exec_root}",
        f"--pidfile={host.dockerd_pidfile}",
        # the machine's path of the host's own /run/docker.sock: never the machine's /run, even if the
        # host's /run were not bound in its mount namespace
        f"--host=unix://{host.docker_sock}",
        f"--containerd={host.containerd_sock}",
        "--bridge=none",
        "--iptables=false",
        "--ip-forward=false",
        "--ip-masq=false",
        "--userland-proxy=false",
        "--shutdown-timeout=2",  # containers get 2 s to stop before SIGKILL
        "--log-level=warn",
    ]


def _ping(host: HostLayout) -> bool:
    if not socket_answers(host.docker_sock):
        return False
    try:
        with closing(docker.DockerClient(base_url=f"unix://{host.docker_sock}", timeout=5)) as c:
            return bool(c.ping())
    except docker.errors.DockerException:
        return False
    except OSError:
        return False


def _exited(pid_of: str, host: HostLayout, logfile: Path, proc_pid: int) -> str | None:
    if alive(proc_pid):
        return None
    tail = logfile.read_text(errors="replace").strip().splitlines()[-3:] if logfile.exists() else []
    return f"{pid_of} exited; last log lines ({logfile}): {' | '.join(tail)}"


def spawn_containerd(host: HostLayout) -> int:
    for d in (host.containerd_root, host.containerd_state, host.log_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    conf = host.dir / "containerd.toml"
    conf.write_text(containerd_toml(host))
    p = spawn(in_host(host, ["containerd", "--config", str(conf)]), host.log_dir / "containerd.log")
    (host.dir / "containerd.pid").write_text(str(p.pid))
    return p.pid


def wait_containerd(host: HostLayout, pid: int) -> None:
    log_ = host.log_dir / "containerd.log"
    try:
        wait_until(lambda: socket_answers(host.containerd_sock), START_TIMEOUT,
                   f"containerd of {host.alias}", lambda: _exited("containerd", host, log_, pid))
    except Exception as e:
        raise StartError(str(e)) from e


def spawn_dockerd(host: HostLayout) -> int:
    for d in (host.data_root, host.exec_root, host.log_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (host.dir / "daemon.json").write_text(daemon_json(host))
    p = spawn(in_host(host, dockerd_argv(host)), host.log_dir / "dockerd.log")
    return p.pid


def wait_dockerd(host: HostLayout, pid: int) -> None:
    log_ = host.log_dir / "dockerd.log"
    try:
        wait_until(lambda: _ping(host), START_TIMEOUT, f"dockerd of {host.alias}",
                   lambda: _exited("dockerd", host, log_, pid))
    except Exception as e:
        raise StartError(str(e)) from e


def remove_containers(host: HostLayout) -> None:
    """Force-remove every container of the host's daemon (SIGKILL + remove), if the daemon answers."""
    if not socket_answers(host.docker_sock):
        return
    try:
        with closing(docker.DockerClient(base_url=f"unix://{host.docker_sock}", timeout=20)) as c:
            for ctr in c.containers.list(all=True):
                try:
                    ctr.remove(force=True)
                except docker.errors.DockerException as e:
                    log.warning("%s: could not remove container %s: %s", host.alias, ctr.name, e)
    except docker.errors.DockerException as e:
        log.warning("%s: daemon did not answer while removing containers: %s", host.alias, e)


def _own_pid(pidfile: Path, host: HostLayout) -> int | None:
    """The pid in pidfile if it is still a process of this host (its command line names the host dir)."""
    pid = read_pidfile(pidfile)
    return pid if pid and alive(pid) and str(host.dir) in cmdline(pid) else None


def stop_docker(host: HostLayout) -> None:
    """Stop dockerd (it stops its containers within --shutdown-timeout), then containerd, then any
    shim left behind. Every wait is bounded."""
    pid = _own_pid(host.dockerd_pidfile, host)
    if pid:
        stop_pids([pid], grace=15)
    pid = _own_pid(host.dir / "containerd.pid", host)
    if pid:
        stop_pids([pid], grace=5)
    # shims name our containerd's socket on their command line
    shims = pids_matching(str(host.containerd_sock))
    if shims:
        stop_pids(shims, grace=3)
    _kill_runc_leftovers(host)


def _kill_runc_leftovers(host: HostLayout) -> None:
    """Containers whose daemon died before stopping them (e.g. with their own netns, which the netns
    sweep does not reach): runc still knows them under the exec root."""
    root = host.exec_root / "runtime-runc" / "moby"
    if not root.is_dir():
        return
    runc = ["runc", "--root", str(root)]
    if host.mntns.exists():  # the containers' mounts are in the host's mount namespace
        runc = in_host(host, runc)
    ids = run([*runc, "list", "-q"], check=False, timeout=10).stdout.split()
    for cid in ids:
        run([*runc, "delete", "--force", cid], check=False, timeout=10)
