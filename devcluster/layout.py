"""Names and paths of a cluster: one place decides them, so that teardown and gc find everything.

Every object a cluster makes carries its name: netns `dc-<name>-h<i>`, bridge `dcb-<name>`,
host-side veth `dcv-<name>-<i>` (the end inside the netns is `eth0`), iptables comment
`devcluster:<name>`, and one folder `<root>/<name>/` (root: $DEVCLUSTER_ROOT or /var/lib/devcluster,
a real disk, because dockerd's overlay2 cannot live on overlay or tmpfs).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.atomic import write_atomic

from .errors import DevclusterError, UnknownClusterError

NAME_RE = re.compile(r"^[a-z0-9]{1,8}$")
MAX_HOSTS = 32  # keeps `dcv-<8 chars>-<2 digits>` within Linux's 15-character interface names
NETNS_RE = re.compile(r"^dc-([a-z0-9]{1,8})-h(\d+)$")
LINK_RE = re.compile(r"^dc[bv]-([a-z0-9]{1,8})(-\d+)?$")
RULE_COMMENT = "devcluster:"


def state_root() -> Path:
    return Path(os.environ.get("DEVCLUSTER_ROOT", "/var/lib/devcluster"))


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise DevclusterError(f"cluster name {name!r}: use 1-8 characters a-z, 0-9")
    return name


@dataclass(frozen=True)
class HostLayout:
    """Names and paths of host i of cluster name."""

    cluster: str
    index: int
    addr: str
    dir: Path

    @property
    def alias(self) -> str:
        return f"dc-{self.cluster}-h{self.index}"

    @property
    def netns(self) -> str:
        return f"dc-{self.cluster}-h{self.index}"

    @property
    def veth(self) -> str:
        return f"dcv-{self.cluster}-{self.index}"

    @property
    def fs_dir(self) -> Path:
        """The host's own folders (home, tmp, ...), bound over the machine's paths in its mount namespace."""
        return self.dir / "fs"

    @property
    def mntns(self) -> Path:
        """The file that keeps the host's mount namespace alive (an nsfs bind under the cluster's ns/)."""
        return self.dir.parent / "ns" / self.dir.name

    @property
    def docker_sock(self) -> Path:
        """The daemon's socket as the machine sees it: /run/docker.sock in the host's own /run."""
        return self.fs_dir / "run" / "docker.sock"

    @property
    def dockerd_pidfile(self) -> Path:
        """dockerd's pid file where a stock install keeps it: /var/run/docker.pid in the host's own /run (the
        orchestrator reads it over SSH to tell a restarted daemon)."""
        return self.fs_dir / "run" / "docker.pid"

    @property
    def boot_id(self) -> Path:
        """The host's boot id, bound over /proc/sys/kernel/random/boot_id in its mount namespace: a new one
        on each reboot(), as a real reboot gives."""
        return self.dir / "boot_id"

    @property
    def data_root(self) -> Path:
        return self.dir / "docker"

    @property
    def exec_root(self) -> Path:
        return self.dir / "run"

    @property
    def containerd_root(self) -> Path:
        return self.dir / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.dir / "containerd-run"

    @property
    def containerd_sock(self) -> Path:
        return self.containerd_state / "containerd.sock"

    @property
    def ssh_dir(self) -> Path:
        return self.dir / "ssh"

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"


@dataclass
class ClusterState:
    """What `<root>/<name>/cluster.json` holds: enough for `down` and `gc` in another process.

    owner_pid/owner_start name the process whose death makes the cluster garbage (a test session);
    None means the cluster lives until `down` (made by the CLI's `up`)."""

    name: str
    subnet_index: int  # the X of 10.231.X.0/24
    n_hosts: int
    owner_pid: int | None = None
    owner_start: int | None = None
    created: float = 0.0
    user: str = "ddp"  # the login user of every host ("root" for the root-login variant)
    no_sftp: list[int] = field(default_factory=list)  # hosts whose sshd has no sftp subsystem
    shared: str | None = None  # a path every host sees as the same folder (<dir>/shared), as with NFS
    gpus: int = 0  # GPUs each host's simulated nvidia-smi reports (0: no nvidia-smi)
    slurm: bool = False  # a real Slurm: slurmctld on the machine, slurmd on each host (slurmd.py)

    @property
    def dir(self) -> Path:
        return state_root() / self.name

    @property
    def subnet(self) -> str:
        return f"10.231.{self.subnet_index}.0/24"

    @property
    def gateway(self) -> str:
        return f"10.231.{self.subnet_index}.1"

    @property
    def bridge(self) -> str:
        return f"dcb-{self.name}"

    @property
    def ns_dir(self) -> Path:
        """Holds the hosts' mount-namespace files; a private bind of itself, as unshare --mount= needs."""
        return self.dir / "ns"

    @property
    def shared_dir(self) -> Path:
        return self.dir / "shared"

    @property
    def rule_comment(self) -> str:
        return f"{RULE_COMMENT}{self.name}"

    def host(self, i: int) -> HostLayout:
        return HostLayout(self.name, i, f"10.231.{self.subnet_index}.{i + 2}", self.dir / f"h{i}")

    def hosts(self) -> list[HostLayout]:
        return [self.host(i) for i in range(self.n_hosts)]

    def save(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(self.dir / "cluster.json", json.dumps(asdict(self), indent=2).encode(), mode=0o644)

    @staticmethod
    def load(name: str) -> ClusterState:
        path = state_root() / check_name(name) / "cluster.json"
        try:
            return ClusterState(**json.loads(path.read_text()))
        except FileNotFoundError as e:
            raise UnknownClusterError(f"no cluster {name!r} ({path} missing); see `python -m devcluster ls`") from e
        except (ValueError, TypeError) as e:
            raise DevclusterError(f"{path}: unreadable ({e}); remove it with `python -m devcluster gc --all`") from e


def known_states() -> list[ClusterState]:
    """Every cluster with a readable state file."""
    root = state_root()
    states = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if (d / "cluster.json").is_file() and NAME_RE.match(d.name):
                try:
                    states.append(ClusterState.load(d.name))
                except DevclusterError:
                    continue
    return states


@contextmanager
def state_lock() -> Iterator[None]:
    """Serialises claiming a name and subnet (create) with gc, across processes (test sessions)."""
    root = state_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
