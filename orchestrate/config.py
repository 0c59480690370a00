"""Typed, validated configuration for each subcommand, built once from the command line and never mutated: the
option framework (`option`, one declaration per option) and the sections each phase takes. What the options are
checked against lives beside it: gpuspec.py (--gpus), hostdirs.py (the job's folders), masking.py (secrets masked) and
trainerargs.py (--entry and the trainer's options)."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from orchestrate.errors import ConfigError
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hostdirs import host_dir_problem
from orchestrate.masking import mask_text, secret_values, url_masked
from orchestrate.trainerargs import check_entry, check_trainer_args
from trainer import config as trainer_config
from trainer.contract import ARCHIVE_MD5, ARCHIVE_NAME, METRICS_FILE
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
MD5_RE = re.compile(r"^[0-9a-f]{32}$")
LAYER_CACHE_MODES = ("auto", "on", "off")
RELAY_MODES = ("auto", "on", "off")
# --relay auto: a relay from this many nodes that get layers sent (plan/relay.py says why)
RELAY_AUTO_FROM = 3
# a relay node serves the archive to at most this many nodes; past that, nodes that fetched it serve the next ones
# (a tree: plan/relay.py says why 4)
RELAY_FAN_OUT = 4

DEFAULT_JOB = "cifar"
DEFAULT_IMAGE = "ddp-cifar:latest"
DEFAULT_DATA_URL = f"https://www.cs.toronto.edu/~kriz/{ARCHIVE_NAME}"
DEFAULT_DATA_MD5 = ARCHIVE_MD5
# Per user on each node (~ is the SSH login's home there): never a fixed folder in world-writable /var/tmp.
DEFAULT_DATA_DIR = "~/.cache/ddp-cifar/data"
DEFAULT_CKPT_DIR = "~/.local/share/ddp-cifar/jobs/{job}/checkpoints"
DEFAULT_LOG_DIR = "~/.local/share/ddp-cifar/jobs/{job}/logs"
DEFAULT_STALL_TIMEOUT_S = 300.0
MIN_STALL_TIMEOUT_S = 10.0
MAX_RESTARTS = 100
DEFAULT_RESTART_BACKOFF_S = 10.0
MAX_RESTART_BACKOFF_S = 3600.0
TRAINER_ENTRY = "-m trainer"

TRANSPORTS = ("auto", "ib", "socket")  # NCCL's network between the nodes (plan/transport.py)

GPUS_HELP = ("GPUs per node: a number (Docker gives the first N), 'all' (-1), device indices (0,1,2,3 or 4-7; "
             "one GPU: 3-3), or 0 for CPU mode (gloo)")
TRANSPORT_HELP = ("NCCL between the nodes: ib = InfiniBand/RoCE (preflight refuses a node without an active port), "
                  "socket = TCP, auto = IB when every node has it")

def option(default: Any, flag: str | None = None, help: str = "", *, check: dict[str, Any] | None = None,  # noqa: A002
           commands: tuple[str, ...] | dict[str, str] = (), **cli: Any) -> Any:
    """A config field declared once: its default, its `up` flag and help (cli.py builds the parser from them), any
    other argparse keyword (`choices`, `type`, `action`...; `parser_default` when the parser's differs, `parse`
    names cli.py's conversion of the parsed value, `short` a one-letter flag beside it), and `check`: the `check`
    command's flag, when it has one ({} to reuse up's flag and help). No flag: an option of the Python API and job
    files only. A JobsConfig field names instead the `commands` that take its flag (kill, status, logs, plot,
    tensorboard), or maps each to its own help there; an option of both configs (--job, --grace) is declared once
    for both (job_option, grace_option)."""
    return field(default=default, metadata={"flag": flag, "help": help, "check": check, "commands": commands,
                                            "cli": cli})


@dataclass(frozen=True)
class SSHOptions:
    """How every command reaches the hosts: `up`, `check` and the job commands all take these options (cli.py adds
    to --hosts's help the allocators' values and when it is required)."""

    hosts_file: Path | None = option(None, "--hosts", "hosts file", type=Path)
    ssh_config: Path | None = option(None, "--ssh-config", "default ~/.ssh/config", type=Path)
    accept_new_host_keys: bool = option(False, "--accept-new-host-keys", "trust unknown host keys on first use (adds "
                                        "them to known_hosts); changed keys stay refused", action="store_true")


# The commands on a job that runs (or ran), and their help: their options are JobsConfig's fields.
JOB_COMMANDS = {
    "kill": "stop and remove the job's containers",
    "status": "one row per node, the job's progress and restarts",
    "logs": "print or follow the nodes' logs",
    "plot": f"draw the job's {METRICS_FILE} (from node 0): loss, accuracy, images/s, learning rate against step, "
            "restarts marked",
    "tensorboard": "fetch the job's TensorBoard event files (node 0's log dir, and its replica's) into a folder here "
                   "and start TensorBoard on it; Ctrl-C stops it",
}


def job_option() -> Any:
    """--job, declared once for up, check and the job commands (and checked once, by check_job)."""
    return option(DEFAULT_JOB, "--job", "job name (container names and labels)",
                  check={"help": "the job whose settings to use (containers JOB-netcheck-*)"},
                  commands=dict.fromkeys(JOB_COMMANDS, "job name"))


# check's own flags for trainer options of its self-test: flag -> (choices, what it sets). They are passed to the
# trainer before the options after -- (which win), and the trainer's parser checks them as for a job.
SELFTEST_OPTIONS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "--strategy": (trainer_config.STRATEGIES, "the job's strategy"),
    "--precision": (trainer_config.PRECISIONS, "the job's precision (fp16 runs with a gradient scaler)"),
    "--model": (None, "the job's model (e.g. tiny for a quick check on CPU)"),
}


# docker stop's timeout also becomes docker-py's socket timeout: `--grace 1e12` overflowed it, the stop failed and
# the container kept running. torchrun SIGKILLs its workers 30 s after its own SIGTERM whatever the grace, so an
# hour is more than any stop needs (and an allocator's stop signal lead, grace + 60 s, stays within 65535 s).
MAX_GRACE_S = 3600


def grace_option() -> Any:
    """--grace, declared once for up and kill (and bounded once, by check_grace)."""
    return option(60.0, "--grace", f"seconds between SIGTERM and SIGKILL (0 to {MAX_GRACE_S})", type=float,
                  commands=("kill",))


def check_grace(seconds: float, flag: str = "--grace") -> None:
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_GRACE_S):
        raise ConfigError(f"{flag} {seconds} must be a number of seconds from 0 to {MAX_GRACE_S}")


def _one_of(value: str, choices: tuple[str, ...], flag: str) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class Program:
    """what to run"""

    job: str = job_option()
    image: str = option(DEFAULT_IMAGE, "--image", "image to run; sent to nodes that lack it",
                        check={"help": "image to run it in (any image with torch)"})
    entry: str = option(TRAINER_ENTRY, "--entry", "program torchrun starts: '-m pkg.module' or a script path inside "
                        "the image; its arguments go after --")  # docs/DESIGN.md §7
    env: tuple[tuple[str, str], ...] = option((), "--env", "extra environment (repeat)", action="append", parser_default=[],
                                              metavar="KEY=VALUE", parse="env")
    trainer_args: tuple[str, ...] = ()  # the program's arguments (after --), whatever the entry

    def __post_init__(self) -> None:
        check_job(self.job)
        if not IMAGE_RE.fullmatch(self.image) or len(self.image) > MAX_IMAGE_REF:
            raise ConfigError(f"--image {self.image[:80]!r} is not a valid image name (at most {MAX_IMAGE_REF} "
                              "characters); write e.g. ddp-cifar:latest")
        for name, _ in self.env:
            if not ENV_NAME_RE.fullmatch(name):
                raise ConfigError(f"--env {name!r}: not a valid variable name; write --env NAME=VALUE")
        check_entry(self.entry)

    @property
    def is_trainer(self) -> bool:
        return self.entry == TRAINER_ENTRY

    @property
    def pipeline_stages(self) -> int:
        """The trainer's --pp (1 for another program, or without it): the world must divide by it."""
        if not self.is_trainer:
            return 1
        try:
            return trainer_config.parse(["--data-dir", "/data", "--ckpt-dir", "/ckpt", *self.trainer_args])[0].pp
        except TrainerConfigError:  # refused with its own line by UpConfig (check_trainer_args)
            return 1

    @property
    def entry_argv(self) -> tuple[str, ...]:
        """What follows torchrun's own options: ("-m", "pkg.mod") or ("/path/script.py",)."""
        return tuple(self.entry.split(" ", 1)) if self.entry.startswith("-m ") else (self.entry,)

    @property
    def entry_target(self) -> tuple[str, str]:
        """("module", "pkg.mod") or ("script", "/path/x.py")."""
        argv = self.entry_argv
        return ("module", argv[1]) if argv[0] == "-m" else ("script", argv[0])

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class Resources:
    """resources of each node"""

    # GPUS_ALL = every GPU of each host; 0 = CPU mode
    gpus: int = option(GPUS_ALL, "--gpus", GPUS_HELP, parse="gpus", check={})
    gpu_ids: tuple[int, ...] = ()  # --gpus 0,1 or 4-7: these device indices (gpus is then their count)
    nccl_transport: str = option("auto", "--nccl-transport", TRANSPORT_HELP, choices=TRANSPORTS, check={})
    nproc_per_node: int | None = option(None, "--nproc-per-node", "processes per node (default: GPUs, or 1 on CPU)",
                                        type=int)
    # The hosts' GPUs are CPU stand-ins (a devcluster's simulated nvidia-smi): the GPU set is held (labels,
    # CUDA_VISIBLE_DEVICES) while the containers run on CPU. A setting of the hosts, not an option: cli.py takes it
    # from the devcluster's environment (GPUS_ON_CPU_ENV).
    gpus_on_cpu: bool = False
    min_free_gb: float = option(1.0, "--min-free-gb", "free disk each node needs under its dirs", type=float)
    shm_size: str | None = option(None, "--shm-size", "a sized /dev/shm instead of --ipc=host")
    memory: str | None = option(None, "--memory", "memory limit of each node's container, e.g. 24g (docker run "
                                "--memory, no swap beyond it): one job cannot take a shared host down; a container "
                                "over it is OOM-killed (reported)")

    def __post_init__(self) -> None:
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
        if not math.isfinite(self.min_free_gb) or self.min_free_gb < 0:
            raise ConfigError(f"--min-free-gb {self.min_free_gb} must be a number of GB, 0 or more")
        if self.shm_size is not None and not re.fullmatch(r"[0-9]+[bkmgBKMG]?", self.shm_size):
            raise ConfigError(f"--shm-size {self.shm_size!r} is not a size; write e.g. 16g")
        if self.memory is not None:
            check_memory(self.memory)

    @property
    def cpu_mode(self) -> bool:
        """The containers run on CPU (gloo): no GPUs asked for, or GPUs held on a simulated host."""
        return self.gpus == 0 or self.gpus_on_cpu


@dataclass(frozen=True)
class Where:
    """where the job meets and keeps its files on the hosts"""

    master_addr: str | None = option(None, "--master-addr", "rendezvous address (default: node 0's address)",
                                     check={})
    # None: node 0 gets a free port at plan time (plan/ports.py)
    master_port: int | None = option(None, "--master-port", "rendezvous port on node 0 (default: one free there and "
                                     "held by no other job)", type=int, check={})
    data_dir: str = option(DEFAULT_DATA_DIR, "--data-dir", "CIFAR-10 on each node (data_dir= per host wins)")
    ckpt_dir: str = option(DEFAULT_CKPT_DIR, "--ckpt-dir", "{job} expands to the job name")
    log_dir: str = option(DEFAULT_LOG_DIR, "--log-dir", "per-rank stdout/stderr files on each node (read one with "
                          "'logs --rank R')")

    def __post_init__(self) -> None:
        if self.master_port is not None:
            check_port(self.master_port, "--master-port")
        if self.master_addr is not None and not re.fullmatch(r"[A-Za-z0-9.:-]+", self.master_addr):
            raise ConfigError(f"--master-addr {self.master_addr!r} is not a host address; give an IP address")
        for flag, path in (("--data-dir", self.data_dir), ("--ckpt-dir", self.ckpt_dir), ("--log-dir", self.log_dir)):
            problem = host_dir_problem(path)
            if problem:
                raise ConfigError(f"{flag} {path!r}: {problem}")


@dataclass(frozen=True)
class Data:
    """the data set"""

    data_url: str = option(DEFAULT_DATA_URL, "--data-url", "archive each node downloads")
    data_from: Path | None = option(None, "--data-from", "a local folder synced into every node's data dir (only "
                                    "changed files move), or the CIFAR-10 archive to send instead of downloading "
                                    "(another program: any single file)", type=Path)
    data_md5: str = option(DEFAULT_DATA_MD5, "--data-md5", "expected md5 of the archive")

    def __post_init__(self) -> None:
        if self.data_from is not None and not (self.data_from.is_file() or self.data_from.is_dir()):
            raise ConfigError(f"--data-from {shown(self.data_from)}: no such file or folder; give a folder to sync to "
                              f"every node, or the path of {ARCHIVE_NAME}")
        if not re.fullmatch(r"(https?|ftp)://\S+", self.data_url):
            raise ConfigError(f"--data-url {url_masked(self.data_url)!r} is not an http(s) URL")
        if not MD5_RE.fullmatch(self.data_md5):
            raise ConfigError(f"--data-md5 {self.data_md5!r} is not an md5 (32 lowercase hex digits)")


@dataclass(frozen=True)
class Delivery:
    """how the image reaches the nodes"""

    pull: bool = option(False, "--pull", "pull the image on the nodes instead of sending it", action="store_true")
    # where layers for the nodes come from: the local layer cache or `docker save`
    layer_cache: str = option("auto", "--layer-cache", "where the layers a node lacks are read here: 'on' = the local "
                              "layer cache (docker push into a docker-registry on loopback, ~/.cache/ddp-cifar/layers: "
                              "only new layers are compressed), 'off' = one docker save stream (the whole image is "
                              "read every time), 'auto' = on when docker-registry is installed, else off",
                              choices=LAYER_CACHE_MODES)
    relay: str = option("auto", "--relay", "how the image layers and the --data-from files or archive the nodes lack "
                        "reach them: 'on' = sent once from here to "
                        "the first node that lacks some, which serves them to the others inside the cluster for the "
                        "transfer's time (the resume checkpoint: served by the node that holds it, nothing through "
                        "here); 'off' = sent from here to each node; 'auto' = on from "
                        f"{RELAY_AUTO_FROM} such nodes", choices=RELAY_MODES)
    # `submit` passes it to its batch job's `up` (the allocator's page: "The image: submit brings it")
    image_from: Path | None = option(None, "--image-from", "first load the image into this machine's Docker (only "
                                     "the layers it lacks) from this manifest, which `submit` wrote on storage the "
                                     "nodes share; then it is sent to the nodes as always", type=Path)

    def __post_init__(self) -> None:
        _one_of(self.layer_cache, LAYER_CACHE_MODES, "--layer-cache")
        _one_of(self.relay, RELAY_MODES, "--relay")
        if self.image_from is not None and not self.image_from.is_file():
            raise ConfigError(f"--image-from {shown(self.image_from)}: no such file; it is the manifest `submit` "
                              "writes into --layer-store")


@dataclass(frozen=True)
class Resilience:
    """self-healing (README: What happens when...)"""

    resume: bool = option(False, "--resume", "continue from the newest valid checkpoint", action="store_true")
    replace: bool = option(False, "--replace", "stop a running job of the same name first", action="store_true")
    stop_on_interrupt: bool = option(False, "--stop-on-interrupt", "Ctrl-C stops the job without asking",
                                     action="store_true")
    grace: float = grace_option()
    # automatic restarts from the newest checkpoint after a failure (0: none)
    max_restarts: int = option(0, "--max-restarts", "after a failure (a node exits non-zero, is OOM-killed, stops "
                               "answering or stalls), stop everywhere and start again from the newest valid "
                               "checkpoint, up to N times", type=int)
    # the wait before the first automatic restart: a daemon restarting or a host rebooting gets that long to come back
    restart_backoff: float = option(DEFAULT_RESTART_BACKOFF_S, "--restart-backoff", "seconds before the first "
                                    "automatic restart (a kill or Ctrl-C meanwhile ends it all), doubled at each "
                                    "further one, at most 6x", type=float)
    min_nodes: int | None = option(None, "--min-nodes", "at a restart, leave out hosts that fail preflight while this "
                                   "many remain (default: every host); the global batch stays the run's own", type=int)
    # no new step for this long (heartbeat) is a failure; 0: off
    stall_timeout: float = option(DEFAULT_STALL_TIMEOUT_S, "--stall-timeout", "seconds without a new training step "
                                  "(rank 0's heartbeat) before the job counts as stalled: stack dumps of every rank, "
                                  "then stop (and restart); at least 3x the slowest step seen; 0: off", type=float)
    ckpt_mirror: Path | None = option(None, "--ckpt-mirror", "also copy each new checkpoint into this folder on this "
                                      "machine (it is always copied to node 1 too, when there is one)", type=Path)

    def __post_init__(self) -> None:
        check_grace(self.grace)
        if self.resume and self.replace:
            raise ConfigError("--resume and --replace together: kill the job first, then 'up --resume'")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be between 0 and {MAX_RESTARTS}")
        if not math.isfinite(self.restart_backoff) or not 0 <= self.restart_backoff <= MAX_RESTART_BACKOFF_S:
            raise ConfigError(f"--restart-backoff {self.restart_backoff} must be between 0 and "
                              f"{MAX_RESTART_BACKOFF_S:g} seconds")
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


@dataclass(frozen=True)
class Checks:
    """the network check"""

    check_network: bool = option(False, "--check-network", "after preflight, measure the network between the nodes "
                                 "(as 'check' does) and start nothing if a node cannot take part; an outlier is named",
                                 action="store_true")
    check_max_mb: int = option(256, "--check-max-mb", "largest message of --check-network (MB)", type=int,
                               check={"flag": "--max-mb", "help": "largest message (MB)"})
    # the all-node all_reduce floor (GB/s); None: the transport's default
    check_min_busbw: float | None = option(None, check={
        "flag": "--min-busbw", "type": float, "metavar": "GBPS", "help": "floor of the all_reduce bus bandwidth "
        "across nodes (GB/s); default by the transport NCCL used: IB 2, sockets 0.05; gloo 0.001"})
    # the floor within each node (GB/s); None: the transport's default
    check_min_node_busbw: float | None = option(None, check={
        "flag": "--min-node-busbw", "type": float, "metavar": "GBPS",
        "help": "floor of the all_reduce bus bandwidth within each node (GB/s); default NCCL 2, gloo 0.001"})

    def __post_init__(self) -> None:
        if not 1 <= self.check_max_mb <= 4096:
            raise ConfigError(f"--max-mb {self.check_max_mb} must be between 1 and 4096 (MB)")
        for flag, floor in (("--min-busbw", self.check_min_busbw), ("--min-node-busbw", self.check_min_node_busbw)):
            if floor is not None and not (math.isfinite(floor) and floor > 0):
                raise ConfigError(f"{flag} {floor} must be a bandwidth in GB/s above 0 (e.g. 0.5)")


@dataclass(frozen=True)
class RunMode:
    """run mode"""

    detach: bool = option(False, "--detach", "return once every container runs", action="store_true")
    # print the plan offline: nothing is contacted (--dry-run); dry_run_hosts: probe the hosts read-only and print
    # the plan, nothing is changed there (--dry-run=hosts)
    dry_run: bool = option(False, "--dry-run", "print the plan and touch nothing: offline (contacts nothing; the "
                           "default), or =hosts (connects and probes every host read-only: folders, image and data "
                           "actions, leftovers, the docker run line, the resume step)", nargs="?", const="offline",
                           choices=("offline", "hosts"), parser_default=None, parse="dry_run")
    dry_run_hosts: bool = False
    as_json: bool = option(False, "--json", "with --dry-run: print the plan as JSON (docs/orchestrate.md)",
                           action="store_true")
    timings: bool = option(False, "--timings", "print each phase's time (seconds) at the end", action="store_true")

    def __post_init__(self) -> None:
        if self.as_json and not (self.dry_run or self.dry_run_hosts):
            raise ConfigError("--json prints a dry run's plan: add --dry-run or --dry-run=hosts")


SECTIONS = {"program": Program, "resources": Resources, "where": Where, "data": Data, "delivery": Delivery,
            "resilience": Resilience, "checks": Checks, "mode": RunMode}
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


def _check_archive_md5(data: Data) -> None:
    """The trainer's archive sent from here (--data-from FILE) has the md5 the nodes will check it against: else
    every node refuses it after the image and the upload, each in a line of its own (seen with the synthetic
    archive and no --data-md5). Read once here: 0.3 s for CIFAR-10's 170 MB."""
    if data.data_from is None or not data.data_from.is_file():
        return
    try:
        with open(data.data_from, "rb") as archive:
            md5 = hashlib.file_digest(archive, "md5").hexdigest()
    except OSError as err:
        raise ConfigError(f"--data-from {shown(data.data_from)}: cannot read it ({err.strerror or err}); check its "
                          "permissions") from None
    if md5 != data.data_md5:
        given = "CIFAR-10's" if data.data_md5 == DEFAULT_DATA_MD5 else "--data-md5"
        raise ConfigError(f"--data-from {shown(data.data_from)}: its md5 is {md5}, not {given} {data.data_md5}; to "
                          f"send this archive as it is (synthetic data, another copy), pass --data-md5 {md5}")


@dataclass(frozen=True)
class UpConfig:
    """`up` and `check`: the hosts (ssh) and one section per concern; each phase is handed the section it reads."""

    ssh: SSHOptions
    program: Program = field(default_factory=Program)
    resources: Resources = field(default_factory=Resources)
    where: Where = field(default_factory=Where)
    data: Data = field(default_factory=Data)
    delivery: Delivery = field(default_factory=Delivery)
    resilience: Resilience = field(default_factory=Resilience)
    checks: Checks = field(default_factory=Checks)
    mode: RunMode = field(default_factory=RunMode)

    def __post_init__(self) -> None:
        if self.program.is_trainer:  # another program's arguments are its own business
            try:
                check_trainer_args(self.program.trainer_args, self.resources.cpu_mode)
            except ConfigError as e:  # the trainer's words may quote an option's value, a secret too
                raise ConfigError(mask_text(str(e), secret_values(self.program.env_dict))) from None
            _check_archive_md5(self.data)

    @classmethod
    def of(cls, ssh: SSHOptions, **options: Any) -> UpConfig:
        """From the options by name (`gpus=8, max_restarts=3`), each into its section."""
        unknown = sorted(set(options) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"UpConfig.of() got an unexpected keyword argument {unknown[0]!r}")
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in options.items():
            by_section[SECTION_OF[key]][key] = value
        return cls(ssh=ssh, **{name: SECTIONS[name](**kw) for name, kw in by_section.items()})

    def options(self) -> dict[str, Any]:
        """Every option by name (the sections flattened): what a job's memory stores and a job file shows."""
        return {f.name: getattr(getattr(self, SECTION_OF[f.name]), f.name)
                for cls in SECTIONS.values() for f in fields(cls)}

    def with_options(self, **changes: Any) -> UpConfig:
        """A copy with these options changed (by name), validated again."""
        return UpConfig.of(self.ssh, **{**self.options(), **changes})


def option_defaults() -> dict[str, Any]:
    """Every option's default by name."""
    return {f.name: f.default for cls in SECTIONS.values() for f in fields(cls)}


@dataclass(frozen=True)
class JobsConfig:
    """kill / status / logs / plot / tensorboard: each option names the commands that take it (cli.py builds their
    parsers from the fields)."""

    ssh: SSHOptions
    job: str = job_option()
    grace: float = grace_option()
    follow: bool = option(False, "--follow", "keep following until the job ends", short="-f", action="store_true",
                          commands=("logs",))
    node: int | None = option(None, "--node", "only this node rank", type=int, commands=("logs",))
    tail: int = option(100, "--tail", "last N lines per node (0: all)", type=int, commands=("logs",))
    rank: int | None = option(None, "--rank", "one global rank's stdout/stderr files (from up's --log-dir on its "
                              "node)", type=int, commands=("logs",))
    out: Path | None = option(None, "--out", type=Path, commands={
        "plot": "PNG to write (default: JOB-metrics.png here)",
        "tensorboard": "folder for the event files (default: JOB-tensorboard here)"})
    port: int | None = option(None, "--port", "TensorBoard's port (default: 6006 or the next free one)", type=int,
                              commands=("tensorboard",))
    all_jobs: bool = option(False, "--all", "every job on the hosts, everyone's: owner, name, nodes, GPUs, age",
                            action="store_true", commands=("status",))

    def __post_init__(self) -> None:
        check_job(self.job)
        check_grace(self.grace)
        if self.node is not None and self.node < 0:
            raise ConfigError(f"--node {self.node} must be a node rank (0 or more)")
        if self.tail < 0:
            raise ConfigError(f"--tail {self.tail} must not be negative")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} must be a TCP port (1-65535)")
        if self.rank is not None and (self.rank < 0 or self.node is not None):
            raise ConfigError(f"--rank {self.rank}: give a global rank (0 or more), without --node")


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
