"""What runs in the containers, checked here before anything starts: `--entry` (a module or a script), and the
trainer's options after `--` through the trainer's own parser (trainer/config.py, no torch)."""

from __future__ import annotations

import re

from orchestrate.errors import ConfigError
from trainer import config as trainer_config
from trainer.errors import ConfigError as TrainerConfigError

MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Set by the orchestrator itself; a user passing them would break the container layout.
RESERVED_TRAINER_OPTIONS = {"--data-dir": "--data-dir of 'up'", "--ckpt-dir": "--ckpt-dir of 'up'",
                            "--resume": "'up --resume'",
                            "--keep-global-batch": "'up --min-nodes' (its restarts on fewer nodes pass it)"}


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
