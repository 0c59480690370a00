"""Typed, validated configuration for each subcommand, built once from the command line and never mutated."""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import ConfigError
from orchestrate.plan.transport import TRANSPORTS
from trainer import config as trainer_config
from trainer.contract import ARCHIVE_MD5, ARCHIVE_NAME
from trainer.errors import ConfigError as TrainerConfigError
from trainer.errors import shown

JOB_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# A Docker image reference: [registry[:port]/]path[:tag][@digest], lowercase path components.
IMAGE_RE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[a-f0-9]{64})?$"
)
# Docker refuses a repository name over 255 characters; with a tag (128) and a digest the reference is longer.
MAX_IMAGE_REF = 255 + 1 + 128 + 72
MAX_SLOTS = 1024  # processes (or GPUs) per node, as the hosts file's slots=: more is a typo, not a machine
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_NAME_RE = re.compile(r"TOKEN|KEY|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.IGNORECASE)
MD5_RE = re.compile(r"^[0-9a-f]{32}$")
MASK = "****"
LAYER_CACHE_MODES = ("auto", "on", "off")

DEFAULT_JOB = "cifar"
DEFAULT_IMAGE = "ddp-cifar:latest"
DEFAULT_DATA_URL = f"https://www.cs.toronto.edu/~kriz/{ARCHIVE_NAME}"
DEFAULT_DATA_MD5 = ARCHIVE_MD5
# Per user on each node (~ is the SSH login's home there): never a fixed folder in world-writable /var/tmp.
DEFAULT_DATA_DIR = "~/.cache/ddp-cifar/data"
DEFAULT_CKPT_DIR = "~/.local/share/ddp-cifar/jobs/{job}/checkpoints"
DEFAULT_LOG_DIR = "~/.local/share/ddp-cifar/jobs/{job}/logs"
GPUS_ALL = -1
DEFAULT_STALL_TIMEOUT_S = 300.0
MIN_STALL_TIMEOUT_S = 10.0
MAX_RESTARTS = 100
TRAINER_ENTRY = "-m trainer"
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Set by the orchestrator itself; a user passing them would break the container layout.
RESERVED_TRAINER_OPTIONS = {"--data-dir": "--data-dir of 'up'", "--ckpt-dir": "--ckpt-dir of 'up'",
                            "--resume": "'up --resume'",
                            "--keep-global-batch": "'up --min-nodes' (its restarts on fewer nodes pass it)"}


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


def masked_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret(k) else v) for k, v in env.items()}


def secret_values(env: dict[str, str]) -> list[str]:
    return [v for k, v in env.items() if is_secret(k) and v]


def url_masked(url: str) -> str:
    """A URL as shown and stored: a user:password@ in it becomes ****@ (the node still gets the real one)."""
    return re.sub(r"//[^/@]*@", "//****@", url)


def mask_text(text: str, secrets: list[str]) -> str:
    """Every secret value hidden; a multi-line secret also line by line (logs are shown a line at a time)."""
    for value in secrets:
        text = text.replace(value, MASK)
        for part in value.splitlines():
            if len(part) >= 4:  # a very short piece would mask ordinary text
                text = text.replace(part, MASK)
    return text


@dataclass(frozen=True)
class SSHOptions:
    hosts_file: Path | None
    ssh_config: Path | None
    accept_new_host_keys: bool


@dataclass(frozen=True)
class UpConfig:
    ssh: SSHOptions
    job: str = DEFAULT_JOB
    image: str = DEFAULT_IMAGE
    gpus: int = GPUS_ALL  # GPUS_ALL = every GPU of each host; 0 = CPU mode
    gpu_ids: tuple[int, ...] = ()  # --gpus 0,1 or 4-7: these device indices (gpus is then their count)
    # Hold the GPU set (labels, CUDA_VISIBLE_DEVICES) but run on CPU: test hosts whose nvidia-smi is simulated.
    gpus_on_cpu: bool = False
    nccl_transport: str = "auto"  # NCCL between the nodes: ib, socket, or auto (IB where every node has it)
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None  # None: node 0 gets a free port at plan time (plan/ports.py)
    data_dir: str = DEFAULT_DATA_DIR
    ckpt_dir: str = DEFAULT_CKPT_DIR
    log_dir: str = DEFAULT_LOG_DIR
    data_url: str = DEFAULT_DATA_URL
    data_from: Path | None = None
    data_md5: str = DEFAULT_DATA_MD5
    env: tuple[tuple[str, str], ...] = ()
    pull: bool = False
    layer_cache: str = "auto"  # where layers for the nodes come from: the local layer cache or `docker save`
    detach: bool = False
    dry_run: bool = False  # print the plan offline: nothing is contacted
    dry_run_hosts: bool = False  # probe the hosts read-only and print the plan: nothing is changed there
    as_json: bool = False  # a dry run's plan as JSON (docs/orchestrate.md)
    timings: bool = False
    resume: bool = False
    replace: bool = False
    stop_on_interrupt: bool = False
    min_free_gb: float = 1.0
    shm_size: str | None = None  # None: --ipc=host
    memory: str | None = None  # each container's memory limit (docker run --memory, no swap beyond it); None: none
    grace: float = 60.0
    trainer_args: tuple[str, ...] = ()  # the program's arguments (after --), whatever the entry
    entry: str = TRAINER_ENTRY  # "-m pkg.mod" or a script path inside the image (docs/DESIGN.md §7)
    max_restarts: int = 0  # automatic restarts from the newest checkpoint after a failure (0: none)
    min_nodes: int | None = None  # at a restart, hosts failing preflight are left out while this many remain
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # no new step for this long (heartbeat) is a failure; 0: off
    ckpt_mirror: Path | None = None  # also copy each new checkpoint into this local folder
    check_network: bool = False  # the network check after preflight, before the job starts
    check_max_mb: int = 256  # the network check's largest message

    def __post_init__(self) -> None:
        check_job(self.job)
        if not IMAGE_RE.fullmatch(self.image) or len(self.image) > MAX_IMAGE_REF:
            raise ConfigError(f"--image {self.image[:80]!r} is not a valid image name (at most {MAX_IMAGE_REF} "
                              "characters); write e.g. ddp-cifar:latest")
        if self.gpus < GPUS_ALL:
            raise ConfigError(f"--gpus {self.gpus} is negative; give a number of GPUs per node, 'all', or 0 for CPU")
        if self.gpus > MAX_SLOTS:
            raise ConfigError(f"--gpus {self.gpus}: at most {MAX_SLOTS} per node; give the GPUs of one node, or 'all'")
        if self.nproc_per_node is not None and not 1 <= self.nproc_per_node <= MAX_SLOTS:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be between 1 and {MAX_SLOTS}")
        if self.gpu_ids and (self.gpus != len(self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids)):
            raise ConfigError(f"--gpus {','.join(map(str, self.gpu_ids))}: give each device index once "
                              "(the indices as gpus=, or gpu_ids= with gpus= their count)")
        if self.nccl_transport not in TRANSPORTS or (self.cpu_mode and self.nccl_transport != "auto"):
            raise ConfigError(f"--nccl-transport {self.nccl_transport!r}: choose one of {', '.join(TRANSPORTS)}; "
                              "it applies to GPU jobs (NCCL), --gpus 0 runs on gloo")
        if self.gpus > 0 and self.nproc_per_node is not None and self.nproc_per_node > self.gpus:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} exceeds --gpus {self.gpus}: one process per GPU")
        if self.master_port is not None:
            check_port(self.master_port, "--master-port")
        if self.gpus_on_cpu and self.gpus == 0:
            raise ConfigError("--gpus-on-cpu holds GPUs while running on CPU: give --gpus N, 'all' or indices with it")
        if self.layer_cache not in LAYER_CACHE_MODES:
            raise ConfigError(f"--layer-cache {self.layer_cache!r}: choose one of {', '.join(LAYER_CACHE_MODES)}")
        if self.master_addr is not None and not re.fullmatch(r"[A-Za-z0-9.:-]+", self.master_addr):
            raise ConfigError(f"--master-addr {self.master_addr!r} is not a host address; give an IP address")
        for flag, path in (("--data-dir", self.data_dir), ("--ckpt-dir", self.ckpt_dir), ("--log-dir", self.log_dir)):
            problem = host_dir_problem(path)
            if problem:
                raise ConfigError(f"{flag} {path!r}: {problem}")
        if self.data_from is not None and not (self.data_from.is_file() or self.data_from.is_dir()):
            raise ConfigError(f"--data-from {shown(self.data_from)}: no such file or folder; give a folder to sync to every "
                              f"node, or the path of {ARCHIVE_NAME}")
        if not re.fullmatch(r"(https?|ftp)://\S+", self.data_url):
            raise ConfigError(f"--data-url {url_masked(self.data_url)!r} is not an http(s) URL")
        if not MD5_RE.fullmatch(self.data_md5):
            raise ConfigError(f"--data-md5 {self.data_md5!r} is not an md5 (32 lowercase hex digits)")
        for name, _ in self.env:
            if not ENV_NAME_RE.fullmatch(name):
                raise ConfigError(f"--env {name!r}: not a valid variable name; write --env NAME=VALUE")
        if not math.isfinite(self.min_free_gb) or self.min_free_gb < 0:
            raise ConfigError(f"--min-free-gb {self.min_free_gb} must be a number of GB, 0 or more")
        if self.shm_size is not None and not re.fullmatch(r"[0-9]+[bkmgBKMG]?", self.shm_size):
            raise ConfigError(f"--shm-size {self.shm_size!r} is not a size; write e.g. 16g")
        if not math.isfinite(self.grace) or self.grace < 0:
            raise ConfigError(f"--grace {self.grace} must be a number of seconds, 0 or more")
        if self.memory is not None:
            check_memory(self.memory)
        if self.as_json and not (self.dry_run or self.dry_run_hosts):
            raise ConfigError("--json prints a dry run's plan: add --dry-run or --dry-run=hosts")
        if self.resume and self.replace:
            raise ConfigError("--resume and --replace together: kill the job first, then 'up --resume'")
        check_entry(self.entry)
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be between 0 and {MAX_RESTARTS}")
        if self.min_nodes is not None and self.min_nodes < 1:
            raise ConfigError(f"--min-nodes {self.min_nodes} must be at least 1")
        if self.min_nodes is not None and self.max_restarts == 0:
            raise ConfigError("--min-nodes applies at automatic restarts; give --max-restarts N too")
        if not math.isfinite(self.stall_timeout) or not (self.stall_timeout == 0 or
                                                         MIN_STALL_TIMEOUT_S <= self.stall_timeout <= 7 * 86400):
            raise ConfigError(f"--stall-timeout {self.stall_timeout} must be 0 (off) or between "
                              f"{MIN_STALL_TIMEOUT_S:g} seconds and a week")
        if self.ckpt_mirror is not None and (self.ckpt_mirror.exists() and not self.ckpt_mirror.is_dir()):
            raise ConfigError(f"--ckpt-mirror {shown(self.ckpt_mirror)} exists and is not a folder; give a folder")
        if not 1 <= self.check_max_mb <= 4096:
            raise ConfigError(f"--max-mb {self.check_max_mb} must be between 1 and 4096 (MB)")
        if self.is_trainer:  # another program's arguments are its own business
            try:
                check_trainer_args(self.trainer_args, self.cpu_mode)
            except ConfigError as e:  # the trainer's words may quote an option's value, a secret too
                raise ConfigError(mask_text(str(e), secret_values(self.env_dict))) from None

    @property
    def is_trainer(self) -> bool:
        return self.entry == TRAINER_ENTRY

    @property
    def entry_argv(self) -> tuple[str, ...]:
        """What follows torchrun's own options: ("-m", "pkg.mod") or ("/path/script.py",)."""
        return tuple(self.entry.split(" ", 1)) if self.entry.startswith("-m ") else (self.entry,)

    @property
    def cpu_mode(self) -> bool:
        """The containers run on CPU (gloo): no GPUs asked for, or GPUs held on a simulated host."""
        return self.gpus == 0 or self.gpus_on_cpu

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class JobsConfig:
    """kill / status / logs."""

    ssh: SSHOptions
    job: str = DEFAULT_JOB
    grace: float = 60.0
    follow: bool = False
    node: int | None = None
    tail: int = 100
    rank: int | None = None  # logs --rank: one global rank's log files
    out: Path | None = None  # plot --out
    all_jobs: bool = False  # status --all: every owner's jobs on the hosts

    def __post_init__(self) -> None:
        check_job(self.job)
        if not math.isfinite(self.grace) or self.grace < 0:
            raise ConfigError(f"--grace {self.grace} must be a number of seconds, 0 or more")
        if self.node is not None and self.node < 0:
            raise ConfigError(f"--node {self.node} must be a node rank (0 or more)")
        if self.tail < 0:
            raise ConfigError(f"--tail {self.tail} must not be negative")
        if self.rank is not None and (self.rank < 0 or self.node is not None):
            raise ConfigError(f"--rank {self.rank}: give a global rank (0 or more), without --node")


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


def check_job(job: str) -> None:
    if not JOB_RE.fullmatch(job):
        raise ConfigError(f"job name {job!r} is not allowed; use lowercase letters, digits, '.', '_', '-' "
                          "(at most 63, starting with a letter or digit)")


def check_port(port: int, flag: str) -> None:
    if not 1024 <= port <= 65535:
        raise ConfigError(f"{flag} {port} out of range; use a free port in 1024-65535 (default 29500)")


SIZE_RE = re.compile(r"([0-9]{1,15})([bkmg]?)", re.IGNORECASE)  # what docker run --memory takes
MIN_MEMORY = 6 << 20  # the Docker daemon refuses a smaller memory limit


def check_memory(text: str) -> None:
    found = SIZE_RE.fullmatch(text)
    if not found:
        raise ConfigError(f"--memory {text!r} is not a size; write e.g. 16g (b, k, m or g)")
    number, unit = found.groups()
    if int(number) << {"": 0, "b": 0, "k": 10, "m": 20, "g": 30}[unit.lower()] < MIN_MEMORY:
        raise ConfigError(f"--memory {text} is below Docker's minimum of 6m; give the memory a node's container "
                          "may use, e.g. 16g")


def check_entry(entry: str) -> None:
    """`-m pkg.mod` or a script path (no spaces); whether it exists in the image is preflight's question."""
    if entry.startswith("-m "):
        if not MODULE_RE.fullmatch(entry[3:]):
            raise ConfigError(f"--entry {entry!r}: {entry[3:]!r} is not a module name; write e.g. --entry '-m pkg.train'")
        return
    if not entry or entry.startswith("-") or any(ch.isspace() or ch == "\x00" for ch in entry):
        raise ConfigError(f"--entry {entry!r}: give '-m pkg.module' or a script path inside the image "
                          "(e.g. /app/train.py); program arguments go after '--'")


def check_trainer_args(args: tuple[str, ...], cpu: bool) -> None:
    """The options after `--` through the trainer's own parser and validation (trainer/config.py, no torch):
    what the containers would refuse is refused here, before anything starts on the cluster."""
    for word in args:
        name = word.partition("=")[0]
        if name in RESERVED_TRAINER_OPTIONS:
            raise ConfigError(f"trainer option {name} is set by the orchestrator; use {RESERVED_TRAINER_OPTIONS[name]}")
    try:
        cfg, _ = trainer_config.parse(["--data-dir", "/data", "--ckpt-dir", "/ckpt", *args])
    except TrainerConfigError as e:
        raise ConfigError(f"trainer options after '--': {e}") from None
    needs_cuda = trainer_config.cuda_only(cfg) if cpu else []
    if not cpu and cfg.device == "cpu":  # the orchestrator passes --device cuda; the user's own wins unless it is this
        raise ConfigError("trainer option --device cpu with GPUs: the job would hold GPUs and train on the CPU; "
                          "use --gpus 0 for a CPU job, or leave --device out (GPU jobs get --device cuda)")
    if needs_cuda:
        option, instead = needs_cuda[0]
        raise ConfigError(f"trainer option {option} needs a GPU, and --gpus 0 runs on CPU; {instead}")
