"""Cluster and Host: the Python API that tests and the demo use.

    with Cluster.create(2) as c:
        c.hosts_file            # orchestrate hosts file (ssh aliases)
        c.hosts[0].docker_client().info()
        c.hosts[1].link_down()
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import docker

from . import dockerd, hostfs, net, seed, slurmd, sshd
from .errors import DevclusterError, NoSubnetError, NotRootError
from .hostfs import as_user, ensure_user, home_of, in_host, path_on_machine
from .layout import MAX_HOSTS, ClusterState, HostLayout, check_name, known_states, state_lock, state_root
from .mounts import fs_type
from .proc import need_tools, start_time
from .teardown import stop_leftovers, teardown, traces

log = logging.getLogger(__name__)

MAX_FAKE_GPUS = 16  # a GPU machine's most; more is a typo
# What tells the orchestrator that the hosts' GPUs are simulated (orchestrate/cli.py reads it, under this name).
GPUS_ON_CPU_ENV = "DEVCLUSTER_GPUS_ON_CPU"
TOOLS = ("ip", "nsenter", "unshare", "iptables", "ssh-keygen", "dockerd", "containerd", "runc", "umount", sshd.SSHD, *hostfs.TOOLS)


class Host:
    """One simulated host: a netns with its own address, a mount namespace with its own /home, /root,
    /tmp, /var/tmp, /mnt and /run, and its own sshd and dockerd in both."""

    def __init__(self, layout: HostLayout, state: ClusterState) -> None:
        self.layout = layout
        self.state = state

    @property
    def name(self) -> str:
        """The ssh alias (Host entry of ssh_config), also the name in hosts.txt."""
        return self.layout.alias

    alias = name

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def addr(self) -> str:
        return self.layout.addr

    @property
    def netns(self) -> str:
        return self.layout.netns

    @property
    def user(self) -> str:
        """The login user (ssh_config's User): `ddp` (non-root, in the docker group), or root."""
        return self.state.user

    @property
    def sftp(self) -> bool:
        """Whether the host's sshd has the sftp subsystem."""
        return self.index not in self.state.no_sftp

    @property
    def home(self) -> str:
        """The login user's home as the host sees it (e.g. /home/ddp)."""
        return home_of(self.user)

    @property
    def docker_sock(self) -> Path:
        """The daemon's socket on the machine; the host sees it at /var/run/docker.sock."""
        return self.layout.docker_sock

    @property
    def docker_host(self) -> str:
        """DOCKER_HOST value for this host's daemon, from the machine itself (not over SSH)."""
        return f"unix://{self.layout.docker_sock}"

    @property
    def dir(self) -> Path:
        return self.layout.dir

    def docker_client(self, timeout: int = 60) -> docker.DockerClient:
        """SDK client on the host's local socket, for test assertions (the orchestrator uses SSH)."""
        return docker.DockerClient(base_url=self.docker_host, timeout=timeout)

    def path(self, path: str) -> Path:
        """Where a path as the host sees it ("/home/ddp/x", "/tmp/y", the shared folder) lies on this
        machine, to read or plant files from a test."""
        return path_on_machine(self.state, self.layout, path)

    def run(self, cmd: Sequence[str], *, user: str = "root", timeout: float = 60, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run argv on the host (its netns and mount namespace) as user: root by default, with this
        process's environment; another user (e.g. host.user, "nobody") with its groups and a login-like
        environment (HOME, USER, PATH)."""
        argv = in_host(self.layout, as_user(user, list(cmd)))
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
        except subprocess.TimeoutExpired as e:
            raise DevclusterError(f"{self.name}: `{' '.join(cmd)}` ran past {timeout:.0f} s") from e
        if check and res.returncode != 0:
            last = (res.stderr.strip().splitlines() or [""])[-1]
            raise DevclusterError(f"{self.name}: `{' '.join(cmd)}` exited {res.returncode}: {last}")
        return res

    def foreign_files(self, path: str) -> list[str]:
        """Paths at or under path (as the host sees it) that do not belong to the login user."""
        entry = pwd.getpwnam(self.user)
        top = self.path(path)
        found = []
        for p in [top, *top.rglob("*")] if top.exists() else []:
            st = p.lstat()
            if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
                found.append(f"{path}/{p.relative_to(top)} ({st.st_uid}:{st.st_gid})")
        return found

    def link_down(self) -> None:
        """The network drops: packets to and from this host are lost until link_up()."""
        net.set_link(self.layout, up=False)

    def link_up(self) -> None:
        net.set_link(self.layout, up=True)

    def throttle(self, rate: str | None) -> None:
        """A slow link (e.g. "30mbit"), both ways: a token bucket on the bridge side of the host's veth (traffic
        to the host) and on its eth0 (traffic from it); None takes it away."""
        net.set_rate(self.layout, rate)
        self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        if rate is not None:
            self.run(["tc", "qdisc", "add", "dev", "eth0", "root", *net.tbf_args(rate)])

    def stop_docker(self) -> None:
        """A node without Docker: dockerd (and its containers, containerd, shims) stop; sshd stays."""
        dockerd.stop_docker(self.layout)

    def start_docker(self) -> None:
        pid = dockerd.spawn_containerd(self.layout)
        dockerd.wait_containerd(self.layout, pid)
        pid = dockerd.spawn_dockerd(self.layout)
        dockerd.wait_dockerd(self.layout, pid)

    def restart_sshd(self, *extra: str) -> None:
        """sshd starts again with the host's stock config plus `extra` lines (a site's hardening, e.g.
        "MaxSessions 3"); with none, the stock config is back. Open sessions stay, as with a real restart."""
        d = self.layout.ssh_dir
        (d / "sshd_config").write_text(sshd.sshd_config(self.layout, self.sftp) + "".join(f"{x}\n" for x in extra))
        sshd.stop_sshd(self.layout)
        sshd.run_sshd(self.layout)

    def reboot(self) -> None:
        """A reboot as the network and the orchestrator see it: every process of the host ends (dockerd with
        its containers, sshd with its sessions, slurmd with its jobs), the host comes back with a new boot id, its
        daemons start again; files, images and host keys stay."""
        self.shut_down()
        self.boot()

    def shut_down(self) -> None:
        """The first half of a slow reboot: every process of the host ends and it stays down (SSH refused, no
        Docker, no slurmd) until boot()."""
        dockerd.stop_docker(self.layout)
        sshd.stop_sshd(self.layout)
        stop_leftovers(self.layout)

    def boot(self) -> None:
        """The host comes back from shut_down() with a new boot id; its daemons start again."""
        hostfs.new_boot_id(self.layout)
        self.start_docker()
        sshd.run_sshd(self.layout)
        if self.state.slurm:
            slurmd.start_node(self.state, self.layout)

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr})"


class Cluster:
    """N simulated hosts on one bridge, with the client files to reach them (see docs/devcluster.md)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.hosts = [Host(h, state) for h in state.hosts()]

    # --- making and removing -------------------------------------------------------------------

    @classmethod
    def create(cls, n_hosts: int, name: str | None = None, *, persistent: bool = False, root_login: bool = False,
               no_sftp: Sequence[int] = (), shared: str | None = None, gpus: int = 0,
               images: Sequence[str] = (), slurm: bool = False) -> Cluster:
        """Bring up n_hosts hosts. Unless persistent, the cluster belongs to this process: once the
        process is gone, `gc` removes it. On any failure everything made so far is removed.

        Variants: root_login (log in as root instead of the non-root `ddp`), no_sftp (indices of hosts
        whose sshd has no sftp subsystem), shared (a path, e.g. "/mnt/shared", that is one folder seen
        by every host, as an NFS mount), gpus (each host's simulated nvidia-smi reports that many GPUs), images
        (local images every host starts with, as if loaded there by hand: seed.py), slurm (a real Slurm:
        munged, slurmctld on this machine, slurmd on each host, its GPUs as gres when gpus: slurmd.py)."""
        if os.geteuid() != 0:
            raise NotRootError("devcluster needs root (netns, bridge, iptables, dockerd); run it as root")
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise DevclusterError(f"--hosts {n_hosts}: choose 1 to {MAX_HOSTS}")
        bad = [i for i in no_sftp if not 0 <= i < n_hosts]
        if bad:
            raise DevclusterError(f"no_sftp {bad}: host indices are 0 to {n_hosts - 1}")
        if shared is not None:
            hostfs.check_shared(shared)
        if not 0 <= gpus <= MAX_FAKE_GPUS:
            raise DevclusterError(f"--gpus {gpus}: choose 0 to {MAX_FAKE_GPUS} simulated GPUs per host")
        need_tools(*TOOLS)
        if slurm:
            need_tools(*slurmd.TOOLS, packages=slurmd.PACKAGES)
        _check_disk()
        user = "root" if root_login else ensure_user().pw_name
        planted = seed.ensure(images, lambda: cls.create(1)) if images else None
        state = _claim(n_hosts, name, None if persistent else os.getpid(),
                       user=user, no_sftp=sorted(set(no_sftp)), shared=shared, gpus=gpus, slurm=slurm)
        try:
            _bring_up(state, planted)
        except BaseException:
            left = teardown(state)
            if left:
                log.error("cluster %s: could not remove: %s", state.name, "; ".join(left))
            raise
        return cls(state)

    @classmethod
    def load(cls, name: str) -> Cluster:
        """The cluster named name, made earlier (e.g. by `python -m devcluster up`)."""
        return cls(ClusterState.load(name))

    def close(self) -> list[str]:
        """Tear down; returns what could not be removed (empty when no trace is left)."""
        return teardown(self.state)

    def traces(self) -> list[str]:
        return traces(self.name)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        left = self.close()
        if left:
            raise DevclusterError(f"cluster {self.name}: left behind: {'; '.join(left)}")

    # --- what clients use ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def dir(self) -> Path:
        """State folder: hosts.txt, ssh_config, known_hosts, id_ed25519(.pub), home/.ssh/, h<i>/."""
        return self.state.dir

    @property
    def user(self) -> str:
        """The login user of every host (ssh_config's User): `ddp` by default, root in the root-login variant."""
        return self.state.user

    @property
    def shared(self) -> str | None:
        """The path every host sees as one folder (shared-storage variant), else None."""
        return self.state.shared

    @property
    def hosts_file(self) -> Path:
        return self.dir / "hosts.txt"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def home(self) -> Path:
        """A HOME whose .ssh/config and .ssh/known_hosts are the cluster's: paramiko-based clients
        (docker-py's ssh://, the orchestrator) started with HOME=cluster.home resolve the aliases."""
        return self.dir / "home"

    @property
    def subnet(self) -> str:
        return self.state.subnet

    @property
    def gateway(self) -> str:
        """The machine's own address on the bridge: hosts reach a server of the machine here."""
        return self.state.gateway

    @property
    def slurm_conf(self) -> Path | None:
        """The cluster's slurm.conf (Slurm variant), else None."""
        return slurmd.slurm_conf(self.state) if self.state.slurm else None

    def client_env(self) -> dict[str, str]:
        """Environment for a client process (the orchestrator, a docker-py script, sinfo/srun/sbatch): this
        process's environment with HOME=cluster.home, so ~/.ssh/config and known_hosts are the cluster's, and
        in the Slurm variant SLURM_CONF=its slurm.conf, so Slurm's clients reach its controller; with simulated
        GPUs, GPUS_ON_CPU_ENV=1, so the orchestrator holds their GPU sets while its containers run on CPU."""
        slurm = {"SLURM_CONF": str(self.slurm_conf)} if self.slurm_conf else {}
        gpus_on_cpu = {GPUS_ON_CPU_ENV: "1"} if self.state.gpus else {}
        return {**os.environ, "HOME": str(self.home), **slurm, **gpus_on_cpu}

    def write_hosts_file(self, path: Path, slots: int = 1,
                         keys: dict[int, dict[str, str]] | None = None, hosts: Sequence[Host] | None = None) -> Path:
        """An orchestrate hosts file for some of the hosts, with extra `key=value`s per host index
        (e.g. {0: {"data_dir": "/tmp/d0"}})."""
        lines = []
        for h in hosts if hosts is not None else self.hosts:
            extra = "".join(f" {k}={v}" for k, v in (keys or {}).get(h.index, {}).items())
            lines.append(f"{h.name} slots={slots}{extra}\n")
        path.write_text("".join(lines))
        return path

    def ssh_argv(self, host: Host, *cmd: str) -> list[str]:
        """OpenSSH client argv for host (OpenSSH ignores $HOME, so the config is passed with -F)."""
        return ["ssh", "-F", str(self.ssh_config), host.name, *cmd]

    def __repr__(self) -> str:
        return f"Cluster({self.name}, {self.subnet}, {len(self.hosts)} hosts)"


def _check_disk() -> None:
    """dockerd's overlay2 cannot keep its layers on overlay or tmpfs: the data roots need a real disk."""
    root = state_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    kind = fs_type(root)
    if kind in ("overlay", "tmpfs", "ramfs", "aufs"):
        raise DevclusterError(f"{root} is on {kind}: point DEVCLUSTER_ROOT at a folder on a real disk (ext4, xfs)")


def _claim(n_hosts: int, name: str | None, owner: int | None, **variant: object) -> ClusterState:
    """Choose a free name and /24 and write cluster.json before making anything, so that teardown and
    gc can always find what follows."""
    with state_lock():
        states = known_states()
        taken = ({s.name for s in states} | {d.name for d in state_root().iterdir()}
                 | {n.split("-")[1] for n in net.netns_names() if n.startswith("dc-")})
        if name is None:
            name = next(n for n in (secrets.token_hex(3) for _ in range(100)) if n not in taken)
        elif check_name(name) in taken:
            raise DevclusterError(f"cluster {name!r} exists; remove it with `python -m devcluster down --name {name}`")
        index = net.pick_subnet_index({s.subnet_index for s in states})
        if index is None:
            raise NoSubnetError("no free 10.231.X.0/24 left; remove old clusters with `python -m devcluster gc`")
        state = ClusterState(name=name, subnet_index=index, n_hosts=n_hosts, owner_pid=owner,
                             owner_start=start_time(owner) if owner else None, created=time.time(),
                             **variant)  # type: ignore[arg-type]
        state.save()
        return state


def _bring_up(state: ClusterState, planted: Path | None = None) -> None:
    """Network, per-host folders and mount namespaces, then all containerds, then all dockerds (their
    start-up waits overlap), sshds. With a seed, each data root gets its images before its dockerd starts."""
    t0 = time.monotonic()
    user_pub = sshd.keygen(state.dir / "id_ed25519", f"devcluster-{state.name}")
    net.create_bridge(state)
    net.allow_forward(state)
    resolvers = net.resolvers()
    hosts = state.hosts()
    hostfs.make_shared_dir(state)
    hostfs.prepare_ns_dir(state)
    for h in hosts:
        h.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        h.log_dir.mkdir(mode=0o700, exist_ok=True)
        hostfs.make_host_dirs(state, h, user_pub)
        hostfs.make_mount_ns(state, h)
        if state.gpus:
            hostfs.install_fake_gpus(h, state.gpus)
        net.create_host_net(state, h, resolvers)
    ctrd = {h.index: dockerd.spawn_containerd(h) for h in hosts}
    for h in hosts:
        dockerd.wait_containerd(h, ctrd[h.index])
    if planted is not None:
        for h in hosts:
            seed.plant(planted, h)
    dkd = {h.index: dockerd.spawn_dockerd(h) for h in hosts}
    for h in hosts:
        dockerd.wait_dockerd(h, dkd[h.index])
    host_keys = {h.index: sshd.start_sshd(h, sftp=h.index not in state.no_sftp) for h in hosts}
    sshd.write_client_files(state, host_keys)
    if state.slurm:
        slurmd.start_slurm(state)
    log.info("cluster %s: %d hosts up in %.1f s", state.name, len(hosts), time.monotonic() - t0)
