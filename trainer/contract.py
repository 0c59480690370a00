"""Everything the trainer and the orchestrator must agree on: CIFAR-10's on-disk table, the checkpoint manifest,
the metrics, heartbeat and stack-dump files, the environment a program is started with, its exit codes and the
log lines the orchestrator looks for. Standard library only: the orchestrator imports this module without torch
(docs/DESIGN.md), so both sides check the same contract and neither keeps a copy of it. tests/test_contract.py
fails when one of these values is spelled out anywhere else. The rule that names a straggler from a heartbeat's
timings is trainer/straggler.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

# ---- CIFAR-10 as published (the same table torchvision checks) ----------------------------------------------
BASE_FOLDER = "cifar-10-batches-py"
ARCHIVE_NAME = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
TRAIN_FILES = (
    ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
    ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
    ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
    ("data_batch_4", "634d18415352ddfa80567beed471001a"),
    ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
)
TEST_FILES = (("test_batch", "40351d587109b95175f43aff81a1287e"),)
META_FILE = ("batches.meta", "5ff9c542aee3614f3951f8cda6e48888")
ALL_FILES = TRAIN_FILES + TEST_FILES + (META_FILE,)

# ---- files global rank 0 writes into the checkpoint dir -------------------------------------------------------
METRICS_FILE = "metrics.jsonl"
# metrics.jsonl holds epoch records, resume/restart events ("event") and, every --log-every steps, step records
# ("kind": STEP_KIND). A reader of epoch records skips the other two.
STEP_KIND = "train_step"
HEARTBEAT_FILE = "heartbeat.json"

# ---- files every rank writes into the log dir ($LOG_DIR) ---------------------------------------------------------
# Global rank 0's TensorBoard event files (events.out.tfevents.*): $LOG_DIR/tensorboard/, or
# CKPT_DIR/tensorboard/ when no LOG_DIR is set (a run started by hand). A program under --entry may write its
# own event files anywhere under $LOG_DIR.
TENSORBOARD_FOLDER = "tensorboard"
TENSORBOARD_EVENTS_PREFIX = "events.out.tfevents."
# torch's NCCL flight-recorder dumps (TORCH_FR_DUMP_TEMP_FILE is this prefix; torch adds the rank)
FR_DUMP_PREFIX = "nccl_trace_rank_"


def stack_file_name(rank: int) -> str:
    """Where a rank's faulthandler writes every thread's stack on SIGUSR1 (the orchestrator's stall report)."""
    return f"stack-rank{rank}.txt"


# ---- the environment the orchestrator starts every program with (docs/DESIGN.md §7) ------------------------------
ENV_DATA_DIR, ENV_CKPT_DIR, ENV_LOG_DIR = "DATA_DIR", "CKPT_DIR", "LOG_DIR"
ENV_RESUME = "RESUME"  # "1" on `up --resume` and on every automatic restart; absent otherwise
# An automatic restart: its number and the failure it follows (one line). The trainer records both in metrics.jsonl.
ENV_RESTART, ENV_RESTART_CAUSE = "DDP_RESTART", "DDP_RESTART_CAUSE"

# ---- how a run ends, for the orchestrator's report -------------------------------------------------------------
# SIGTERM (kill, docker stop, a failing peer node): every rank saves a checkpoint and exits with this code, and
# global rank 0 logs STOP_LINE (torchrun itself then exits 1, so the orchestrator reads the log for the line).
EXIT_STOPPED = 143
STOP_LINE = "stopped by SIGTERM"
# A non-finite loss: every rank exits with this code at the same step (torchrun itself then exits 1, whatever its
# workers' codes, so the orchestrator reads each node's log for DIVERGED_LINE, which the trainer's error line holds).
EXIT_DIVERGED = 3
DIVERGED_LINE = "training diverged"

# ---- where a rank waits for its peers (docs/DESIGN.md §7) --------------------------------------------------
# The trainer's one host wait per agreement is a function of this name (trainer/dist.py): with NCCL a
# collective returns once queued, so a rank blocked on a lost peer shows this frame in its stack dump, not
# torch.distributed's. The orchestrator's stall report counts such a rank as waiting for its peers.
PEER_WAIT_FUNCTION = "wait_for_peers"

# ---- the checkpoint manifest: ckpt-<step>.json beside ckpt-<step>.pt, written last ----------------------------
FORMAT = 1
CKPT_NAME_RE = re.compile(r"ckpt-(\d{8})\.(pt|json)")
MANIFEST_RE = re.compile(r"ckpt-(\d{8})\.json")


def _check_counts(data: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} {value!r} is not a non-negative integer")


def pt_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def manifest_name(step: int) -> str:
    return f"ckpt-{step:08d}.json"


@dataclass(frozen=True)
class Manifest:
    """What a manifest promises about its .pt file. A checkpoint counts only once its manifest exists and the
    .pt has exactly these bytes and this sha256."""

    file: str
    sha256: str
    bytes: int
    step: int
    epoch: int
    epoch_complete: bool
    world_size: int
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "file": self.file, "sha256": self.sha256, "bytes": self.bytes,
                "epoch": self.epoch, "step": self.step, "epoch_complete": self.epoch_complete,
                "world_size": self.world_size, "created": self.created}

    @classmethod
    def parse(cls, data: object) -> Manifest:
        """A manifest from its decoded JSON; ValueError saying what is wrong with it."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("unknown manifest format")
        file = data.get("file")
        if not isinstance(file, str) or not CKPT_NAME_RE.fullmatch(file) or not file.endswith(".pt"):
            raise ValueError(f"file {file!r} is not a checkpoint name")
        sha = data.get("sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError("sha256 is not a hex digest")
        _check_counts(data, ("bytes", "step", "epoch", "world_size"))
        return cls(file, sha, int(data["bytes"]), int(data["step"]), int(data["epoch"]),
                   bool(data.get("epoch_complete", True)), int(data["world_size"]), str(data.get("created", "")))


# ---- sharded (FSDP) checkpoints: one folder per step, in torch.distributed.checkpoint (DCP) format ---------------
# ckpt-<step>/                a folder, renamed into place only once complete
#   .metadata                 DCP's index of every tensor chunk (written by global rank 0)
#   __<rank>_0.distcp         each rank's own shards (model and optimizer state), one file per rank
#   trainer.pt                global rank 0: scaler, RNG, epoch/step/sample, world size, global batch, config
#   manifest.json             written last: every other file's size and sha256
# It is written as .ckpt-<step>.tmp/ by every rank, flushed, then renamed: a folder named ckpt-<step> is
# complete, and it counts once its manifest.json is there and every file matches it. Any world size loads it.
SHARDED_FORMAT = 2
CKPT_FOLDER_RE = re.compile(r"ckpt-(\d{8})")
SHARDED_MANIFEST = "manifest.json"
SHARDED_TRAINER_FILE = "trainer.pt"
SHARDED_TMP_RE = re.compile(r"\.ckpt-(\d{8})\.tmp")
_SHARD_FILE_RE = re.compile(r"(\.metadata|__\d+_\d+\.distcp|trainer\.pt)")


def ckpt_folder_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def ckpt_tmp_name(step: int) -> str:
    return f".ckpt-{step:08d}.tmp"


@dataclass(frozen=True)
class ShardedManifest:
    """What a folder checkpoint's manifest.json promises: these files (a shard of every rank among them), with
    exactly these sizes and sha256."""

    files: dict[str, tuple[int, str]]  # name -> (bytes, sha256)
    step: int
    epoch: int
    epoch_complete: bool
    world_size: int
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"format": SHARDED_FORMAT, "strategy": "fsdp", "step": self.step, "epoch": self.epoch,
                "epoch_complete": self.epoch_complete, "world_size": self.world_size, "created": self.created,
                "files": {name: {"bytes": size, "sha256": sha} for name, (size, sha) in sorted(self.files.items())}}

    @classmethod
    def parse(cls, data: object) -> ShardedManifest:
        """A manifest from its decoded JSON; ValueError saying what is wrong with it."""
        if not isinstance(data, dict) or data.get("format") != SHARDED_FORMAT:
            raise ValueError("unknown manifest format")
        _check_counts(data, ("step", "epoch", "world_size"))
        raw = data.get("files")
        if not isinstance(raw, dict) or ".metadata" not in raw or SHARDED_TRAINER_FILE not in raw:
            raise ValueError("files must list .metadata and trainer.pt")
        files: dict[str, tuple[int, str]] = {}
        for name, entry in raw.items():
            if not isinstance(name, str) or not _SHARD_FILE_RE.fullmatch(name):
                raise ValueError(f"file {name!r} is not a checkpoint file name")
            size, sha = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
            if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise ValueError(f"file {name!r} has no valid bytes/sha256")
            files[name] = (size, sha)
        missing = [r for r in range(int(data["world_size"])) if not any(n.startswith(f"__{r}_") for n in files)]
        if missing:
            raise ValueError(f"files lack the shards of rank(s) {missing}")
        return cls(files, int(data["step"]), int(data["epoch"]), bool(data.get("epoch_complete", True)),
                   int(data["world_size"]), str(data.get("created", "")))


# ---- the GPU probe's answer (trainer/gpuprobe.py, one JSON line; judged by orchestrate/probe/gpuprobe.py) -----------
# arch: the container's uname -m; torch/cuda: torch's version and the CUDA it was built for (None: a CPU build);
# driver_cuda: cuDriverGetVersion (e.g. 12080; None: no libcuda.so.1); driver: the kernel module's release;
# count: torch.cuda.device_count(); nccl: NCCL's version; kernel: "ok" or what a tiny kernel hit;
# warning: torch's CUDA initialization warning, or why torch did not import; cu_init: cuInit's CUresult (None: no
# libcuda.so.1) and cu_error: CUDA's name and words for it; denied: the GPU and RDMA device files the job's user
# cannot open, as "path: reason".
GPU_PROBE_FIELDS = ("arch", "torch", "cuda", "driver_cuda", "driver", "count", "nccl", "kernel", "warning",
                    "cu_init", "cu_error", "denied")

# ---- the self-test's answer (python -m trainer.selftest: a line per process, SELFTEST_MARK + JSON; `check`) --
# One line from every process: rank, world_size, device, strategy, precision, scaler (whether a gradient scaler
# ran), steps, loss (the last step's), step_s (seconds per step after the first), ckpt_bytes, ckpt_ok (saved,
# found by its manifest, restored, weights equal), error (None, or the one line that says what failed).
SELFTEST_MARK = "SELFTEST "
SELFTEST_FIELDS = ("rank", "world_size", "device", "strategy", "precision", "scaler", "steps", "loss", "step_s",
                   "ckpt_bytes", "ckpt_ok", "error")


_B = TypeVar("_B", bound="Beat")


# ---- the heartbeat: CKPT_DIR/heartbeat.json, rewritten atomically by global rank 0 (docs/DESIGN.md §2) -----------
@dataclass(frozen=True)
class Beat:
    """One heartbeat. Only `step` is required: another program's (docs/DESIGN.md §7) may hold nothing else, and
    the trainer leaves out what it does not know yet (loss, speed, ETA before the first timed window)."""

    step: int
    state: str = "training"  # starting | training | evaluating | checkpointing | stopped | done
    total_steps: int | None = None
    epoch: int | None = None
    epochs: int | None = None
    loss: float | None = None
    images_per_s: float | None = None  # over the steps since the last beat
    eta_s: float | None = None  # from the run's average step, evaluations and checkpoints included
    slowest_step_s: float = 0.0  # the orchestrator's stall check waits at least 3x this
    ckpt_step: int | None = None  # this run's newest checkpoint
    time: float | None = None  # when it was written: epoch seconds by the writer's clock
    raw: str = field(default="", compare=False)  # the file as read: any change in it is progress
    # Every rank's own timings over the last agreement window (AGREE_EVERY steps), seconds per step, index =
    # global rank: `rank_step_s` the wall clock of a step (about the same on every rank: a synchronous job runs at
    # its slowest rank's pace), `rank_work_s` the rank's own work in it (data wait + forward: no collective in
    # either under DDP), whose ratio to the median is the straggler score (straggler.straggler_scores).
    rank_step_s: tuple[float, ...] | None = None
    rank_work_s: tuple[float, ...] | None = None
    rank_data_s: tuple[float, ...] | None = None  # the data-wait part of rank_work_s
    ranks_per_node: int | None = None  # node of a rank = rank // ranks_per_node (torchrun's LOCAL_WORLD_SIZE)
    rank_score: tuple[float, ...] | None = None  # straggler.straggler_scores(rank_work_s), rounded
    node_score: tuple[float, ...] | None = None  # straggler_scores(node_times(rank_work_s, ranks_per_node))
    mfu: float | None = None  # model FLOPs/s over the job's peak; absent: not applicable (CPU, GPU not in table)
    # Per rank, how many agreement windows in a row (up to straggler.STRAGGLER_WINDOWS) it has been clearly
    # slower (straggler.clearly_slower): straggler.slowest() names only a rank at STRAGGLER_WINDOWS; absent (an
    # older trainer's beat): nobody.
    rank_streak: tuple[int, ...] | None = None
    # Under --pp, each rank's pipeline stage (index = global rank; ranks r*dp .. r*dp+dp-1 hold stage r; with the
    # interleaved schedule a rank also holds stage s + pp, s + 2pp, ...): a stage's ranks wait on the slowest
    # stage, so straggler.slowest() says which. Absent: the job is not pipelined.
    rank_stage: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """What the file holds: the fields known, not `raw`."""
        return {k: v for k, v in asdict(self).items() if v is not None and k != "raw"}

    @classmethod
    def parse(cls: type[_B], text: str) -> _B | None:
        """None for a file that is not a heartbeat (half written, another program's format)."""
        try:
            data = json.loads(text)
            return cls(int(data["step"]), str(data.get("state", "training")), _int(data.get("total_steps")),
                       _int(data.get("epoch")), _int(data.get("epochs")), _float(data.get("loss")),
                       _float(data.get("images_per_s")), _float(data.get("eta_s")),
                       _float(data.get("slowest_step_s")) or 0.0, _int(data.get("ckpt_step")),
                       _float(data.get("time")), text, _floats(data.get("rank_step_s")),
                       _floats(data.get("rank_work_s")), _floats(data.get("rank_data_s")),
                       _int(data.get("ranks_per_node")), _floats(data.get("rank_score")),
                       _floats(data.get("node_score")), _float(data.get("mfu")),
                       _ints(data.get("rank_streak")), _ints(data.get("rank_stage")))
        except (ValueError, KeyError, TypeError):
            return None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)
