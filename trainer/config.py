"""The trainer's one configuration object: built once from the command line, validated, saved in checkpoints.

Standard library only: the orchestrator checks a job's trainer options with this very parser and validation
before anything starts on the cluster, without importing torch (docs/DESIGN.md §1).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .contract import BASE_FOLDER, EXIT_DIVERGED, EXIT_STOPPED, METRICS_FILE, STOP_LINE
from .errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
# "auto": bf16 on a GPU with bf16 tensor cores, fp32 elsewhere (trainer/defaults.py resolves it at start).
PRECISION_CHOICES = ("auto", *PRECISIONS)
CKPT_ASYNC = ("auto", "on", "off")
# The global batch --lr is given for on GPU when --lr-ref-batch is auto (defaults.scaled_lr: linear below it, square root past it).
LR_REF_BATCH = 256
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600
COMPRESSIONS = ("none", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "apex-fused-sgd")
# --compile: torch.compile's backend for the training step's module, or off. inductor generates kernels (the one
# that can make a GPU step faster); aot_eager traces forward and backward without generating code: it shows that
# the model compiles, at a fraction of inductor's compile time on a CPU.
COMPILE_BACKENDS = ("off", "inductor", "aot_eager")
STRATEGIES = ("ddp", "fsdp")
FSDP_SHARD = ("node", "all")
# The trainer's own models (trainer/models.py builds them); any other name must be a torchvision model's.
MODEL_NAMES = ("resnet18", "resnet18-gn", "resnet20", "resnet20-gn", "tiny", "vit-cifar")
# The models --pp splits, and their blocks (a test keeps this equal to trainer/models.py): torch-free, so that the
# orchestrator refuses a split the model cannot take before anything starts. BatchNorm models are not here.
PP_MODEL_BLOCKS = {"resnet18-gn": 8, "resnet20-gn": 9, "vit-cifar": 8}
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved")
PP_SPLITS = ("auto", "uniform")
TORCHVISION_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Config:
    """Every setting of one training run. Frozen: nothing changes it after the command line is parsed."""

    data_dir: Path
    """Folder holding ``cifar-10-batches-py/`` (or ``cifar-10-python.tar.gz``, extracted on first use)."""
    ckpt_dir: Path
    """Checkpoints and metrics.jsonl go here (written by global rank 0 only)."""
    epochs: int = 30
    batch_size: int = 128
    """Per process; the global batch is batch_size x world size."""
    lr: float = 0.1
    """Peak learning rate for a global batch of lr_ref_batch (scaled to the run's by defaults.scaled_lr), reached
    after the warmup, then decayed with a cosine to 0 at the last epoch."""
    lr_ref_batch: int | None = None
    """The global batch --lr is given for: the run uses lr x global batch / this up to it, lr x sqrt(global batch /
    this) past it (defaults.scaled_lr). None: auto (256 on GPU; on CPU --lr as given). 0: --lr as given."""
    warmup_epochs: float | None = None
    """Linear warmup; None: auto (1 epoch, 5 when --lr-ref-batch raises the lr, at most half the run)."""
    momentum: float = 0.9
    weight_decay: float = 5e-4
    model: str = "resnet18"
    precision: str = "auto"
    strategy: str = "ddp"
    """ddp: a full replica per process. fsdp: parameters, gradients and optimizer state sharded (FSDP2)."""
    fsdp_shard: str = "node"
    """fsdp over several nodes: shard within each node and replicate across nodes (HSDP), or shard over all."""
    sync_bn: bool = False
    grad_compression: str = "none"
    optimizer: str = "sgd"
    compile: str = "off"
    """torch.compile the module the training step calls (the DDP wrapper: DDPOptimizer splits the graph at its
    buckets); off by default until a GPU run shows it helps. Checkpoints hold the plain module's keys."""
    eval_every: int | None = None
    """Evaluate every N epochs (and always after the last one). None: auto (every epoch on CPU, not by epoch on
    GPU)."""
    eval_every_minutes: float | None = None
    """Evaluate at an epoch's end when this many minutes passed since the last (0: off). None: auto (1 on GPU,
    off on CPU)."""
    ckpt_every: int | None = None
    """Write a checkpoint every N epochs (and always at the end, at --max-steps and on SIGTERM). None: auto
    (every epoch on CPU, not by epoch on GPU)."""
    ckpt_every_minutes: float | None = None
    """Also write one when this many minutes passed since the last, mid-epoch if need be (0: off). None: auto
    (5 on GPU, off on CPU)."""
    ckpt_async: str = "auto"
    """on: copy the state to the CPU, write and hash it in a background thread while training goes on. auto:
    on for GPU jobs, off on CPU."""
    keep_checkpoints: int = 3
    resume: bool = False
    keep_global_batch: bool = False
    """On --resume with fewer processes: keep the checkpoint's global batch (gradient accumulation)."""
    seed: int = 0
    max_steps: int = 0
    """Stop after this many global steps (0: no limit)."""
    allow_unverified_data: bool = False
    dist_timeout: float = 300.0
    """Seconds a collective may wait for a peer before the job fails instead of hanging."""
    device: str = "auto"
    log_every: int = 50
    eval_batch_size: int = 500
    pp: int = 1
    """Pipeline stages: the processes form a (pp x dp) mesh, pp outermost; 1: no pipelining."""
    pp_schedule: str = "1f1b"
    """1f1b, gpipe, or interleaved (interleaved 1F1B with 2 stages per process)."""
    pp_microbatches: int | None = None
    """Micro-batches per step and data-parallel replica. None: 4 x pp."""
    pp_split: str = "auto"
    """auto: balanced by each block's measured time; uniform: equal block counts; or block counts per stage."""

    def __post_init__(self) -> None:
        _positive("--epochs", self.epochs, "the number of passes over the training set")
        _positive("--batch-size", self.batch_size, "images per process and step")
        _positive("--eval-every", self.eval_every, "epochs between evaluations")
        _positive("--ckpt-every", self.ckpt_every, "epochs between checkpoints")
        if self.lr_ref_batch is not None and self.lr_ref_batch < 0:
            raise ConfigError(f"--lr-ref-batch must be the global batch --lr is given for, 'none' (--lr as given) "
                              f"or 'auto', got {self.lr_ref_batch}")
        _positive("--keep-checkpoints", self.keep_checkpoints, "how many checkpoints to keep")
        _positive("--log-every", self.log_every, "steps between progress lines")
        _positive("--eval-batch-size", self.eval_batch_size, "images per evaluation batch")
        for flag, value in (("--lr", self.lr), ("--warmup-epochs", self.warmup_epochs), ("--momentum", self.momentum),
                            ("--weight-decay", self.weight_decay), ("--dist-timeout", self.dist_timeout),
                            ("--ckpt-every-minutes", self.ckpt_every_minutes),
                            ("--eval-every-minutes", self.eval_every_minutes)):
            if value is not None and not math.isfinite(value):  # nan passes every comparison below, inf overflows timedelta
                raise ConfigError(f"{flag} must be a finite number, got {value}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}; a usual value is 0.1 for a global batch of 256 (--lr-ref-batch)")
        if self.warmup_epochs is not None and self.warmup_epochs < 0:
            raise ConfigError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        for flag, minutes in (("--ckpt-every-minutes", self.ckpt_every_minutes),
                              ("--eval-every-minutes", self.eval_every_minutes)):
            if minutes is not None and not 0 <= minutes <= MAX_DIST_TIMEOUT_S / 60:
                raise ConfigError(f"{flag} must be between 0 (off) and {MAX_DIST_TIMEOUT_S // 60} (a week), "
                                  f"got {minutes}")
        if self.max_steps < 0:
            raise ConfigError(f"--max-steps must be >= 0 (0 means no limit), got {self.max_steps}")
        if not 0 < self.dist_timeout <= MAX_DIST_TIMEOUT_S:
            raise ConfigError(f"--dist-timeout must be > 0 and at most {MAX_DIST_TIMEOUT_S} seconds (a week), "
                              f"got {self.dist_timeout}")
        if not 0 <= self.seed < 2**63:  # torch's generators take a signed 64-bit seed
            raise ConfigError(f"--seed must be between 0 and 2**63-1, got {self.seed}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("--momentum and --weight-decay must be >= 0")
        _choice("--precision", self.precision, PRECISION_CHOICES)
        _choice("--ckpt-async", self.ckpt_async, CKPT_ASYNC)
        _choice("--grad-compression", self.grad_compression, COMPRESSIONS)
        _choice("--device", self.device, DEVICES)
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--strategy", self.strategy, STRATEGIES)
        _choice("--fsdp-shard", self.fsdp_shard, FSDP_SHARD)
        _choice("--compile", self.compile, COMPILE_BACKENDS)
        if self.fsdp_shard != "node" and self.strategy != "fsdp":
            raise ConfigError(f"--fsdp-shard {self.fsdp_shard} applies to --strategy fsdp only: add --strategy fsdp "
                              "or drop --fsdp-shard")
        refused = fsdp_refuses(self)
        if refused:
            option, why = refused[0]
            raise ConfigError(f"--strategy fsdp cannot honour {option}: {why}")
        if self.model not in MODEL_NAMES and not TORCHVISION_NAME_RE.fullmatch(self.model):
            raise ConfigError(f"--model {self.model!r} is not a model: choose one of {', '.join(MODEL_NAMES)} "
                              "or a torchvision classification model (e.g. resnet50)")
        _check_pipeline(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint loads with ``torch.load(weights_only=True)``."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


# Options a CPU cannot run: (the option as written, whether this config uses it, what to do instead). The
# trainer refuses them on a CPU device; the orchestrator refuses them with --gpus 0 before anything starts.
CUDA_ONLY: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("--sync-bn", lambda c: c.sync_bn, "SyncBatchNorm does not run on CPU tensors; drop --sync-bn"),
    ("--grad-compression bf16", lambda c: c.grad_compression == "bf16",
     "gloo cannot run the bf16 hook; use --grad-compression fp16 on CPU"),
    ("--optimizer apex-fused-sgd", lambda c: c.optimizer == "apex-fused-sgd", "use --optimizer sgd on CPU"),
    ("--device cuda", lambda c: c.device == "cuda", "use --device auto or cpu"),
)


# Options --strategy fsdp cannot honour: (the option as written, whether this config uses it, why and what to do).
# Config refuses them while it is built, so the trainer and the orchestrator (which parses a job's trainer
# options with this module) give the same one line before anything starts.
FSDP_REFUSES: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("--compile", lambda c: c.compile != "off",
     "torch.compile of FSDP2's sharded blocks is not tried here yet; use --strategy ddp --compile, or drop --compile"),
    ("--grad-compression", lambda c: c.grad_compression != "none",
     "FSDP2 has no DDP communication hooks; it reduce-scatters gradients in fp32 and all-gathers parameters "
     "in the --precision dtype; drop --grad-compression"),
    ("--sync-bn", lambda c: c.sync_bn,
     "torch's SyncBatchNorm supports only DistributedDataParallel; use --strategy ddp --sync-bn, or a model "
     "without BatchNorm (vit-cifar, resnet18-gn)"),
    ("--optimizer apex-fused-sgd", lambda c: c.optimizer == "apex-fused-sgd",
     "apex's multi-tensor kernels take plain CUDA tensors, not FSDP's sharded DTensor parameters; use --optimizer sgd"),
)


# Options --pp cannot honour: (the option as written, whether this config uses it, why and what to do).
PP_REFUSES: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("--sync-bn", lambda c: c.sync_bn,
     "a pipeline's micro-batches are normalised one by one, so SyncBatchNorm cannot see the batch; use a -gn model"),
    ("--grad-compression", lambda c: c.grad_compression != "none",
     "DDP's communication hooks do not run inside a pipeline stage's backward; drop --grad-compression"),
    ("--optimizer apex-fused-sgd", lambda c: c.optimizer == "apex-fused-sgd",
     "apex is not tested with the pipeline's stages; use --optimizer sgd"),
    ("--precision fp16", lambda c: c.precision == "fp16",
     "the pipeline's schedule runs backward itself, without the gradient scaler; use --precision bf16 or fp32"),
    ("--compile", lambda c: c.compile != "off",
     "torch.compile of pipeline stages is not tried here yet (the schedule calls each stage's module); drop --compile"),
)


def pp_microbatches(cfg: Config) -> int:
    """--pp-microbatches, or its default (4 x pp: a bubble of (p-1)/(5p-1), under 20%)."""
    return cfg.pp_microbatches if cfg.pp_microbatches is not None else 4 * cfg.pp


def pp_stages(cfg: Config) -> int:
    """Stages of the whole pipeline: 2 per process with the interleaved schedule."""
    return cfg.pp * (2 if cfg.pp_schedule == "interleaved" else 1)


def pp_split_counts(cfg: Config) -> list[int] | None:
    """An explicit --pp-split (block counts per stage), or None for auto and uniform."""
    if cfg.pp_split in PP_SPLITS:
        return None
    try:
        return [int(n) for n in cfg.pp_split.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-split must be auto, uniform or block counts per stage such as 3,5; "
                          f"got {cfg.pp_split!r}") from None


def _check_pipeline(cfg: Config) -> None:
    """--pp's refusals, every one decidable from the command line alone (the world size is checked at start)."""
    _positive("--pp", cfg.pp, "pipeline stages; 1: no pipelining")
    _positive("--pp-microbatches", cfg.pp_microbatches, "micro-batches per step")
    _choice("--pp-schedule", cfg.pp_schedule, PP_SCHEDULES)
    counts = pp_split_counts(cfg)
    if cfg.pp == 1:
        return
    for option, used, why in PP_REFUSES:
        if used(cfg):
            raise ConfigError(f"--pp cannot honour {option}: {why}")
    blocks = PP_MODEL_BLOCKS.get(cfg.model)
    if blocks is None:
        why = ("it has BatchNorm, and each micro-batch would be normalised with its own statistics, not the "
               "batch's" if cfg.model in ("resnet18", "resnet20") else "it is not split into blocks here")
        raise ConfigError(f"--pp cannot split --model {cfg.model}: {why}; use one of {', '.join(PP_MODEL_BLOCKS)}")
    stages, micro = pp_stages(cfg), pp_microbatches(cfg)
    if cfg.pp > blocks:
        raise ConfigError(f"--pp {cfg.pp} exceeds the {blocks} blocks of {cfg.model}: each stage needs at least one")
    if stages > blocks:
        raise ConfigError(f"--pp-schedule interleaved puts 2 stages on each process: {stages} stages need at least "
                          f"{stages} blocks, {cfg.model} has {blocks}; lower --pp or use 1f1b")
    if cfg.pp_schedule != "gpipe" and micro < cfg.pp:
        raise ConfigError(f"--pp-schedule {cfg.pp_schedule} needs at least as many micro-batches as stages: "
                          f"--pp-microbatches {micro} < --pp {cfg.pp}; raise it or use gpipe")
    if cfg.pp_schedule == "interleaved" and micro % max(1, micro // cfg.pp):
        raise ConfigError(f"--pp-schedule interleaved needs --pp-microbatches a multiple of its rounds "
                          f"({micro // cfg.pp}); use a multiple of --pp")
    replica = cfg.batch_size * cfg.pp  # the global batch (batch x world) over dp = world / pp replicas
    if replica % micro:
        raise ConfigError(f"--pp: the global batch must divide by dp x micro-batches: each replica takes "
                          f"--batch-size {cfg.batch_size} x --pp {cfg.pp} = {replica} images, not divisible by "
                          f"--pp-microbatches {micro}")
    if counts is not None and (len(counts) != stages or sum(counts) != blocks or min(counts) < 1):
        raise ConfigError(f"--pp-split {cfg.pp_split}: give {stages} positive block counts that add up to the "
                          f"{blocks} blocks of {cfg.model}")


def fsdp_refuses(cfg: Config) -> list[tuple[str, str]]:
    """The options of `cfg` that --strategy fsdp cannot honour, each with why and what to do instead."""
    if cfg.strategy != "fsdp":
        return []
    return [(option, why) for option, used, why in FSDP_REFUSES if used(cfg)]


def cuda_only(cfg: Config) -> list[tuple[str, str]]:
    """The options of `cfg` that need CUDA, each with what to use instead."""
    return [(option, instead) for option, used, instead in CUDA_ONLY if used(cfg)]


def _positive(option: str, value: int | None, meaning: str) -> None:
    """None: the option was left at auto."""
    if value is not None and value < 1:
        raise ConfigError(f"{option} must be a positive integer ({meaning}), got {value}")


def _choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a ConfigError: each of the trainer's CLIs prints it as one
    ``error: ...`` line (exit 2), the orchestrator names it as a trainer option of the job. No option is taken by
    a prefix of its name (`--data` is not `--data-dir`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


_EXAMPLES = f"""\
examples:
  python -m trainer.data synth --out /tmp/cifar --train 5000 --test 1000     # synthetic data, official layout
  python -m trainer --data-dir /tmp/cifar --ckpt-dir /tmp/ckpt --allow-unverified-data --model resnet20 --epochs 2
  torchrun --nproc_per_node 2 -m trainer --data-dir /data --ckpt-dir /ckpt --precision bf16
  torchrun --nproc_per_node 2 -m trainer --data-dir /data --ckpt-dir /ckpt --precision bf16 --resume

exit codes: 0 done, 2 bad input (one 'error:' line), {EXIT_DIVERGED} diverged (non-finite loss; no checkpoint of it),
{EXIT_STOPPED} {STOP_LINE} after writing a checkpoint.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples' line breaks and shows every option's default."""


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--data` must not pass as --data-dir (the orchestrator reserves that one), and a
    # typo such as `--epoch` is refused instead of guessed.
    p = OneLineParser(prog="python -m trainer", formatter_class=_Formatter, epilog=_EXAMPLES,
                       description="DDP CIFAR-10 trainer: one process with python, N with torchrun "
                                   "(gloo on CPU, NCCL with one process per GPU).")
    d = Config.__dataclass_fields__
    p.add_argument("--data-dir", type=Path, required=True, help=f"folder holding {BASE_FOLDER}/")
    p.add_argument("--ckpt-dir", type=Path, required=True, help=f"checkpoints and {METRICS_FILE} go here")
    p.add_argument("--epochs", type=int, default=d["epochs"].default, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, help="per process")
    p.add_argument("--lr", type=float, default=d["lr"].default,
                   help="peak learning rate for a global batch of --lr-ref-batch")
    p.add_argument("--lr-ref-batch", type=_ref_batch, default=d["lr_ref_batch"].default, metavar="N|none|auto",
                   help="the run uses lr x global batch / N up to N images, lr x sqrt(global batch / N) past "
                        "them; none: --lr as given; "
                        f"auto (None): {LR_REF_BATCH} on GPU, none on CPU")
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"].default,
                   help="linear warmup, then cosine decay to 0; auto (None): 1, or 5 when --lr-ref-batch raises "
                        "the lr (at most half the run)")
    p.add_argument("--momentum", type=float, default=d["momentum"].default, help="SGD (Nesterov) momentum")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"].default, help="L2 weight decay")
    p.add_argument("--model", default=d["model"].default,
                   help="resnet18 (CIFAR variant), resnet20, resnet18-gn, resnet20-gn, tiny, vit-cifar (25M params), "
                        "or a torchvision name")
    p.add_argument("--precision", default=d["precision"].default, choices=PRECISION_CHOICES,
                   help="autocast dtype; fp16 adds a gradient scaler; auto: bf16 on a GPU with bf16 tensor "
                        "cores, else fp32")
    p.add_argument("--strategy", default=d["strategy"].default, choices=STRATEGIES,
                   help="ddp: a full model replica per process; fsdp: parameters, gradients and optimizer state "
                        "sharded over the processes (FSDP2), checkpoints in DCP folders that resume at any world size")
    p.add_argument("--fsdp-shard", default=d["fsdp_shard"].default, choices=FSDP_SHARD,
                   help="with --strategy fsdp on several nodes with the same process count: node shards within "
                        "each node and replicates across nodes (HSDP: no all-gather crosses nodes, only one "
                        "all-reduce of gradient shards per FSDP unit and step: each block, the norm layers, the "
                        "root); all shards over every process (least memory per GPU)")
    p.add_argument("--sync-bn", action="store_true", default=d["sync_bn"].default, help="SyncBatchNorm across processes (CUDA only)")
    p.add_argument("--grad-compression", default=d["grad_compression"].default, choices=COMPRESSIONS, help="DDP communication hook")
    p.add_argument("--compile", default=d["compile"].default, choices=COMPILE_BACKENDS,
                   help="torch.compile the training step's model with this backend (inductor: generated kernels; "
                        "aot_eager: traced, no code generation); off by default")
    p.add_argument("--optimizer", default=d["optimizer"].default, choices=OPTIMIZERS,
                   help="apex-fused-sgd needs NVIDIA apex built from source (never the PyPI 'apex')")
    p.add_argument("--eval-every", type=int, default=d["eval_every"].default,
                   help="epochs; auto (None): 1 on CPU, not by epoch on GPU")
    p.add_argument("--eval-every-minutes", type=float, default=d["eval_every_minutes"].default,
                   help="evaluate at an epoch's end when this many minutes passed since the last (0: off); "
                        "auto (None): 1 on GPU, off on CPU")
    p.add_argument("--ckpt-every", type=int, default=d["ckpt_every"].default,
                   help="epochs; auto (None): 1 on CPU, not by epoch on GPU")
    p.add_argument("--ckpt-every-minutes", type=float, default=d["ckpt_every_minutes"].default,
                   help="also checkpoint when this many minutes passed since the last, mid-epoch if need be "
                        "(0: off); auto (None): 5 on GPU, off on CPU")
    p.add_argument("--ckpt-async", default=d["ckpt_async"].default, choices=CKPT_ASYNC,
                   help="write checkpoints in a background thread after a copy to the CPU (the end, --max-steps "
                        "and a stop still end with a complete one); auto: on for GPU jobs")
    p.add_argument("--keep-checkpoints", type=int, default=d["keep_checkpoints"].default,
                   help="older checkpoints are deleted")
    p.add_argument("--resume", action="store_true", default=d["resume"].default, help="continue from the newest valid checkpoint")
    p.add_argument("--keep-global-batch", action="store_true", default=d["keep_global_batch"].default,
                   help="with --resume on fewer processes: keep the checkpoint's global batch by gradient "
                        "accumulation (the orchestrator's restarts on fewer nodes pass it)")
    p.add_argument("--seed", type=int, default=d["seed"].default, help="model init, data order and augmentation")
    p.add_argument("--max-steps", type=int, default=d["max_steps"].default, help="stop after this many global steps (0: no limit)")
    p.add_argument("--allow-unverified-data", action="store_true", default=d["allow_unverified_data"].default,
                   help="accept data whose md5 is not official")
    p.add_argument("--dist-timeout", type=float, default=d["dist_timeout"].default, help="seconds a collective waits for a lost peer")
    p.add_argument("--device", default=d["device"].default, choices=DEVICES, help="auto: cuda:LOCAL_RANK if CUDA, else cpu")
    p.add_argument("--log-every", type=int, default=d["log_every"].default, help="steps")
    p.add_argument("--eval-batch-size", type=int, default=d["eval_batch_size"].default,
                   help="images per evaluation batch")
    p.add_argument("--pp", type=int, default=d["pp"].default,
                   help="pipeline stages (a pp x dp mesh, pp outermost); inside a stage --strategy ddp or fsdp; "
                        "models: " + ", ".join(PP_MODEL_BLOCKS))
    p.add_argument("--pp-schedule", default=d["pp_schedule"].default, choices=PP_SCHEDULES,
                   help="torch.distributed.pipelining's schedule; interleaved: 2 stages per process")
    p.add_argument("--pp-microbatches", type=int, default=d["pp_microbatches"].default,
                   help="micro-batches per step and replica; auto (None): 4 x --pp")
    p.add_argument("--pp-split", default=d["pp_split"].default, metavar="auto|uniform|N,N,...",
                   help="auto: blocks balanced by their measured time (an exact dynamic program); uniform: equal "
                        "counts; or block counts per stage")
    # torch.distributed.launch (legacy) passes this; torchrun's LOCAL_RANK environment variable wins.
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _ref_batch(text: str) -> int | None:
    """--lr-ref-batch: a global batch, `none` (0: --lr as given) or `auto` (None)."""
    if text in ("auto", "none"):
        return None if text == "auto" else 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a global batch size, 'none' or 'auto', got {text!r}") from None


def parse(argv: list[str] | None = None) -> tuple[Config, int | None]:
    """Parse the command line into a validated Config and the legacy --local-rank value (if given)."""
    ns = vars(build_parser().parse_args(argv))
    legacy_local_rank = ns.pop("local_rank")
    return Config(**ns), legacy_local_rank
