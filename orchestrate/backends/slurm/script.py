"""PURE: what `submit` gives sbatch (its options and the batch script, batch.sh, as it is), and Slurm's refusal
in one line naming our option."""

from __future__ import annotations

import shlex
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path

from orchestrate.config import MAX_SLOTS, check_grace, option
from orchestrate.errors import ConfigError
from orchestrate.masking import mask_text

BATCH_SCRIPT = Path(__file__).with_name("batch.sh")
# Run by batch.sh on every node; its text travels as an argument of the job (as batch.sh's does in sbatch), so the
# nodes need not see this folder.
GUARD_SCRIPT = Path(__file__).with_name("guard.sh")
# Slurm checks its --signal timers about once a minute, so the signal may come up to 60 s early (sbatch(1)):
# the stop's grace and this slack are how long before the time limit the job is asked to stop.
SIGNAL_SLACK_S = 60
# What the stop needs beside the containers' grace: `kill` starting, connecting to every node and removing.
# guard.sh waits as long (grace + 5 s) before it SIGKILLs what that stop has not ended.
STOP_OVERHEAD_S = 5
# How long a container runs on once its node's guard is gone without its stop (Slurm SIGKILLed it, with no SIGTERM
# first): the guard renews the lease every 5 s (guard.sh's RENEW_S), so a lease lapses only after 12 renewals
# missed, not on a `docker exec` slowed by load; a lapsed lease SIGTERMs the container's command (a checkpoint).
LEASE_S = 60
# Words of Slurm's refusals → the option of ours that asked for it.
_OPTIONS = (("partition", "--partition"), ("gres", "--gpus-per-node"), ("generic resource", "--gpus-per-node"),
            ("node configuration", "--nodes/--gpus-per-node"), ("node count", "--nodes"),
            ("time limit", "--time"))


@dataclass(frozen=True)
class Submission:
    """`submit`'s options: Slurm's (each flag declared here once, with its help: the command line's parser is built
    from them), and the `up` the batch script runs."""

    job: str
    up_args: tuple[str, ...]  # up's options, as given (a secret's --env without its value: `secret_env` holds it)
    trainer_args: tuple[str, ...]
    nodes: int = option(MISSING, "--nodes", "nodes to ask Slurm for", type=int, required=True)
    gpus_per_node: int | None = option(None, "--gpus-per-node", "GPUs to ask Slurm for on each node", type=int)
    partition: str | None = option(None, "--partition", "Slurm partition (default: Slurm's default)")
    time: str | None = option(None, "--time", "Slurm time limit in its forms: minutes, MM:SS, HH:MM:SS, D-HH, "
                              "D-HH:MM, D-HH:MM:SS; 0 or UNLIMITED: none; the job is stopped with a checkpoint "
                              "before it")
    output: str | None = option(None, "--output", "the batch job's output file, on the first node (sbatch -o; "
                                "default: Slurm's slurm-%%j.out in this folder)")
    python: str = option(sys.executable, "--python", "the Python that runs the orchestrator on the first node: a "
                         "path that node sees")
    stop_grace: int = option(20, "--stop-grace", "seconds each container gets to save its checkpoint at scancel or "
                             "the time limit; keep it below Slurm's KillWait (scontrol show config)", type=int)
    layer_store: Path | None = option(None, "--layer-store", "a folder every node sees (shared storage) where the "
                                      "image built here is written for the batch job's `up` (only the layers not "
                                      "there yet); default: $XDG_STATE_HOME/ddp-cifar/images", type=Path)
    dry_run: bool = option(False, "--dry-run", "print the sbatch command and the script; submit nothing",
                           action="store_true")
    # Passed to sbatch in its environment, never on its command line (`ps` and `scontrol show job` show that to
    # every user): the secrets of up's --env, which the batch script's `up --env NAME` reads from its own.
    secret_env: tuple[tuple[str, str], ...] = ()
    # up's options that `kill` takes too (the ssh config, host keys): the batch script's stop reaches the nodes
    # as its `up` did.
    connect_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes {self.nodes}: ask for at least 1")
        if self.gpus_per_node is not None and not 0 <= self.gpus_per_node <= MAX_SLOTS:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node} must be between 0 and {MAX_SLOTS}")
        if not self.python.strip():
            raise ConfigError("--python is empty; give the Python that runs the orchestrator on the first node "
                              f"(default: {sys.executable})")
        check_grace(self.stop_grace, "--stop-grace")
        if self.time is not None:
            limit_seconds(self.time)  # a form Slurm would not take is refused now, naming --time
        too_short = time_problem(self.time, self.stop_grace)
        if too_short:
            raise ConfigError(too_short)


def sbatch_argv(s: Submission) -> list[str]:
    """The sbatch command line: Slurm's options, then the batch script and its arguments."""
    # --no-requeue: a job whose node died ends NODE_FAIL (its guards stop the rest) rather than run batch.sh
    # again from scratch over the old job's files; `submit --resume` continues it (Slurm's default requeues it).
    # --export=ALL (Slurm's default, made sure of): the batch script runs with this environment (PYTHONPATH, HOME,
    # the secrets of secret_env).
    argv = ["sbatch", "--parsable", f"--job-name={s.job}", f"--nodes={s.nodes}", "--no-requeue", "--export=ALL",
            f"--signal=B:TERM@{s.stop_grace + SIGNAL_SLACK_S}"]
    argv += [f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []
    argv += [f"--partition={s.partition}"] if s.partition else []
    argv += [f"--time={s.time}"] if s.time else []
    argv += [f"--output={s.output}"] if s.output else []
    return [*argv, str(BATCH_SCRIPT), s.python, s.job, str(s.stop_grace), str(LEASE_S),
            GUARD_SCRIPT.read_text(), str(len(s.connect_args)), *s.connect_args, *s.up_args,
            "--", *s.trainer_args]


def time_problem(time: str | None, stop_grace: int) -> str | None:
    """Why a --time would have Slurm's stop signal come at the job's start (None: it would not, or it sets no
    limit)."""
    seconds = limit_seconds(time) if time else None
    lead = stop_grace + SIGNAL_SLACK_S
    if seconds is None or seconds > lead:
        return None
    return (f"--time {time}: the job is asked to stop --stop-grace + {SIGNAL_SLACK_S} s ({lead} s) before its limit, "
            f"so it would stop as it starts; give more than {lead} s (--time {lead // 60 + 1})")


_NO_LIMIT = ("-1", "infinite", "unlimited")  # Slurm's words for no limit (any case), beside 0


def limit_seconds(time: str) -> int | None:
    """Slurm's time limit in seconds: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds (sbatch(1)); None for no limit (0, -1, INFINITE, UNLIMITED).
    Any other text is refused (ConfigError naming --time), as sbatch would refuse it."""
    if time.lower() in _NO_LIMIT:
        return None
    days, dash, rest = time.partition("-") if "-" in time else ("0", "", time)
    fields = rest.split(":")
    if not all(f.isdigit() for f in [days, *fields]) or len(fields) > 3:
        raise ConfigError(f"--time {time!r} is not a Slurm time limit; write minutes (90), MM:SS, HH:MM:SS, D-HH, "
                          "D-HH:MM or D-HH:MM:SS, or 0 (or UNLIMITED) for none")
    # The first field is hours after a day count, and in h:m:s; minutes otherwise.
    units = (3600, 60, 1) if dash or len(fields) == 3 else (60, 1)
    return int(days) * 86400 + sum(int(f) * u for f, u in zip(fields, units, strict=False)) or None


def grace_problem(stop_grace: int, kill_wait: int | None) -> str | None:
    """Why the containers could not save their checkpoints before Slurm's SIGKILL (None: they can)."""
    if kill_wait is None or stop_grace + STOP_OVERHEAD_S <= kill_wait:
        return None
    return (f"--stop-grace {stop_grace}: Slurm kills the job {kill_wait} s after its SIGTERM (KillWait), and the stop "
            f"takes up to --stop-grace + {STOP_OVERHEAD_S} s; give at most {max(kill_wait - STOP_OVERHEAD_S, 0)}")


def dry_run_text(s: Submission) -> str:
    """What `submit --dry-run` prints: the command (the guard's text, its 5th script argument, shown as the file it
    is read from; a secret's value masked wherever it appears) and the two scripts."""
    argv = sbatch_argv(s)
    at = argv.index(GUARD_SCRIPT.read_text())
    command = f"{shlex.join(argv[:at])} \"$(cat {GUARD_SCRIPT})\" {shlex.join(argv[at + 1:])}"
    command = mask_text(command, [value for _, value in s.secret_env if value])
    secrets = (f"# in sbatch's environment, not its command line: {' '.join(name for name, _ in s.secret_env)}\n"
               if s.secret_env else "")
    return (f"# submitted with:\n{command}\n{secrets}# {BATCH_SCRIPT.name}:\n{BATCH_SCRIPT.read_text()}"
            f"# {GUARD_SCRIPT.name} (run by {BATCH_SCRIPT.name} on every node):\n{GUARD_SCRIPT.read_text()}")


def refusal(argv: list[str], stderr: str) -> str:
    """Slurm's own refusal in one line, with our option it concerns: `sbatch refused --partition: invalid
    partition specified: gpu`."""
    errors = [line.split("error:", 1)[1].strip() for line in stderr.splitlines() if "error:" in line]
    text = errors[0] if errors else " ".join(stderr.split())[:200] or "no message"
    option = next((opt for word, opt in _OPTIONS if word in text.lower()), None)
    return f"{argv[0]} refused " + (f"{option}: " if option else f"'{shlex.join(argv[1:4])}': ") + text
