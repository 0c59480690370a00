"""What the probe observed, as plain data: the types the plan is decided on (plan/ imports only these of probe/,
so that the pure plan loads neither SSH nor Docker). The probe's modules fill them."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrate.labels import GPUS_LABEL, JOB_LABEL, OWNER_LABEL, PORT_LABEL
from orchestrate.remote.identity import Identity

TORCHRUN = ("torchrun",)


@dataclass(frozen=True)
class Checkpoint:
    host: str
    folder: str
    file: str
    step: int
    epoch: int
    epoch_complete: bool
    bytes: int
    sha256: str
    manifest: str
    files: tuple[tuple[str, int, str], ...] = ()  # (name relative to folder, bytes, sha256), the manifest not among them

    @property
    def path(self) -> str:
        return posixpath.join(self.folder, self.file)

    @property
    def manifest_name(self) -> str:
        """The manifest relative to the checkpoint dir: ckpt-<step>.json, or ckpt-<step>/manifest.json."""
        return posixpath.relpath(self.manifest, self.folder)


@dataclass(frozen=True)
class LocalBase:
    """The base the job's image was built on (its label org.opencontainers.image.base.name), as this machine knows
    it: a node that lacks its layers may pull it from its registry instead of receiving them from here."""

    name: str  # as the label gives it
    layers: int  # how many leading layers of the image are the base's (0: not known here)
    ref: str  # what a node pulls: the name pinned to the base's registry digest (name@sha256:...)
    why: str = ""  # why no node may pull it ("" when the nodes are asked whether they reach its registry)


def lacks_base(base: LocalBase, held: int) -> bool:
    """PURE: whether a node that holds `held` leading layers of the image lacks some of its base's. Where the base's
    layers are not known here, only a node that holds none of the image's is sure to."""
    return held < base.layers if base.layers else held == 0


@dataclass(frozen=True)
class CheckResult:
    """One preflight check's result on one node."""

    check: str
    ok: bool
    text: str
    warn: bool = False


@dataclass(frozen=True)
class GpuSeen:
    """What nvidia-smi said on a node, as it said it (the plan decides the GPU set from it: plan/gpuset.py)."""

    smi: str  # "ok", "missing" (no nvidia-smi), else what it printed when it failed
    count: int = 0  # GPUs visible
    gpu_list: str = ""  # `--query-gpu=index,uuid --format=csv,noheader`
    compute_apps: str = ""  # `--query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader`


def gpu_seen(probed: Mapping[str, str]) -> GpuSeen | None:
    """PURE: nvidia-smi's answer in the probe script's output (None: not asked, a CPU job)."""
    if "smi" not in probed:
        return None
    return GpuSeen(probed["smi"], int(probed.get("gpus") or 0), probed.get("gpu_list", ""),
                   probed.get("compute_apps", ""))


@dataclass(frozen=True)
class NodeFacts:
    """What the probe observed on a node and the plan needs (read-only: nothing was changed to learn it). Only
    observations: the GPU set, the port and the actions are the plan's decisions, preflight's verdicts its own."""

    iface: str | None = None  # interface carrying the master address on this node
    gpus: int | None = None  # GPUs visible on the node (None: not queried)
    home: str | None = None  # the SSH login's home on the node ("~" stays in the dirs until known)
    user: str | None = None  # "uid:gid" of the SSH login: containers run as that user (None: not known yet)
    login: str | None = None  # the login's name, for programs that ask who they are (getpass)
    addr: str | None = None  # the node's address toward the master (its peers see connections from it)
    ib: bool | None = None  # an active InfiniBand/RoCE port and its verbs devices (None: not probed)
    gpu: GpuSeen | None = None  # what nvidia-smi said (None: not asked, a CPU job, or not probed)
    holdings: Holdings = field(default_factory=lambda: Holdings())  # what the containers on its daemon hold
    dirs: Mapping[str, str] | None = None  # data/ckpt/log folders resolved by preflight (None: not probed)
    image_id: str | None = None  # the job's image on the node (None: missing)
    layers_held: int = 0  # how many leading layers of the local image the node's daemon holds
    base_reach: str = "the node was not asked"  # "": its daemon reaches the registry of the image's base; else why not
    data_present: bool = False  # the data folder holds a verified copy of the data
    leftovers: tuple[str, ...] = ()  # containers of the job found there (removed before the start)


@dataclass(frozen=True)
class LocalImage:
    """The job's image on this machine, as the plan needs it (None in the plan: no local image)."""

    id: str
    diff_ids: tuple[str, ...]  # its layers (RootFS), oldest first
    sizes: tuple[int, ...] | None  # each layer's uncompressed size, oldest first (None: not known)
    base: LocalBase | None = None  # None: the image records no base

    @property
    def layers(self) -> int:
        return len(self.diff_ids)


@dataclass(frozen=True)
class Holdings:
    others: list[Held] = field(default_factory=list)  # other jobs' claims, and the caller's other jobs'
    own_gpus: tuple[int, ...] = ()  # what the caller's containers of this job held last
    own_port: int | None = None


HOLDING = ("running", "restarting", "created")  # states in which a container holds its GPUs and its port


@dataclass(frozen=True)
class Held:
    """One container on a daemon, as far as GPU sets and ports go."""

    id: str
    who: str  # "bob/cifar": owner login and job, for people to read
    gpus: tuple[int, ...]
    port: int | None
    created: str  # Docker's RFC 3339 creation time


def held(cid: str, labels: Mapping[str, str], status: str, created: str) -> Held | None:
    """PURE: what a container holds, from its labels and state; None when it holds nothing (exited, or no GPU
    and no port label)."""
    if status not in HOLDING:
        return None
    ids = label_ids(labels.get(GPUS_LABEL, ""))
    port_text = labels.get(PORT_LABEL, "")
    port = int(port_text) if port_text.isdigit() else None
    if not ids and port is None:
        return None
    who = f"{labels.get(OWNER_LABEL) or '?'}/{labels.get(JOB_LABEL, '?')}"
    return Held(cid, who, ids, port, created)


def label_ids(text: str) -> tuple[int, ...]:
    """PURE: the indices of a `ddp-cifar.gpus` label ("0,1")."""
    return tuple(int(i) for i in text.split(",") if i.strip().isdigit())


@dataclass(frozen=True)
class ContainerSeen:
    """One container as its daemon lists it (the scheduler reads it: backends/docker_ssh/observe.py)."""

    id: str
    status: str  # the daemon's word: created, running, exited, ...
    labels: Mapping[str, str] = field(default_factory=dict)
    created: str = ""  # Docker's RFC 3339 creation time
    name: str = ""  # read for the caller's own containers (preflight's job check), not for the claims


@dataclass(frozen=True)
class Check:
    """One cell of preflight's table: a verdict of plan/verdicts.py."""

    ok: bool
    text: str
    warn: bool = False  # passed, but worth a look (shown yellow)


@dataclass(frozen=True)
class HostReport:
    """Preflight's row for one host, built once (pipeline/preflight.py): what the probe observed there and the
    verdicts on it (`checks`, plan/verdicts.py's); `problems` empty means it passed."""

    label: str
    checks: Mapping[str, Check] = field(default_factory=dict)
    iface: str | None = None
    addr: str | None = None  # this node's address toward the master: what its peers see it connect from
    gpu: GpuSeen | None = None  # what nvidia-smi said (None: not asked)
    ib: bool | None = None  # an InfiniBand/RoCE port NCCL can use (None: not probed)
    image_id: str | None = None
    containers: tuple[ContainerSeen, ...] = ()  # the caller's own of this job
    identity: Identity | None = None  # the SSH login there: containers run as it, ~ in the dirs is its home
    dirs: Mapping[str, str] = field(default_factory=dict)  # the data/ckpt/log dirs, ~ resolved
    clock_skew: float = 0.0  # seconds the host's clock is ahead (+) or behind (-) this machine's, at least
    holdings: Holdings = field(default_factory=Holdings)  # what the containers on the daemon hold (labels)
    port: int | None = None  # node 0: the master port chosen or given (None: refused, or not node 0)
    listening: frozenset[int] = frozenset()  # node 0: ports something listens on

    @property
    def gpus(self) -> int | None:
        """GPUs visible (None: nvidia-smi not asked, or it failed)."""
        return self.gpu.count if self.gpu is not None and self.gpu.smi == "ok" else None

    @property
    def problems(self) -> list[str]:
        return [f"{name}: {c.text}" for name, c in self.checks.items() if not c.ok]


@dataclass(frozen=True)
class Launcher:
    """How the image can start the job's processes: torchrun (or `python -m torch.distributed.run` where it is not on
    PATH), and where the image has it, `python -m trainer.launch` (torchrun's options, one process a node, no agent;
    None: the image lacks it). The plan chooses between them (plan/jobplan.py `launch_head`)."""

    torchrun: tuple[str, ...] = TORCHRUN
    one_process: tuple[str, ...] | None = None
