"""Command line: `python -m orchestrate up | check | kill | status | logs | plot | tensorboard`, and each registered
allocator's own subcommands (backends/allocators.py ALLOCATORS).

argparse → one frozen, validated config per subcommand → one function per subcommand. Expected failures
(OrchestrateError) are caught here only, printed as one line (or one line per host), non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from orchestrate.backends.allocators import ALLOCATORS
from orchestrate.backends.protocol import Allocation
from orchestrate.config import JOB_COMMANDS, SECTIONS, SELFTEST_OPTIONS, JobsConfig, SSHOptions, UpConfig
from orchestrate.errors import ConfigError, MultiHostError, OrchestrateError
from orchestrate.gpuspec import parse_gpus, split
from orchestrate.terminal import console_for

EXAMPLES = """\
examples:
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 -- --epochs 30 --precision bf16
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 --dry-run -- --epochs 30
  python -m orchestrate status --job r18
  python -m orchestrate logs --job r18 -f --node 1
  python -m orchestrate plot --job r18 --out r18.png
  python -m orchestrate tensorboard --job r18
  python -m orchestrate check --hosts hosts.txt --gpus 8
  python -m orchestrate kill --job r18
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 --resume -- --epochs 30 --precision bf16
""" + "".join(s.examples for s in ALLOCATORS) + """
hosts file: one host a line, [user@]host[:port] [slots=N] [key=value ...], '#' comments; the first host
is node 0 and the rendezvous master. Keys: slots, gpu_ids (device indices), iface, docker_host, data_dir, ckpt_dir,
log_dir. Names resolve through ~/.ssh/config; host keys are checked against known_hosts.
""" + "".join(s.epilog for s in ALLOCATORS)


# The defaults are the configs' own (config.py): written once, shown by --help, used by job files (jobfile.py).
# up's and check's options are the config sections' fields, and kill's, status's, logs's, plot's and
# tensorboard's are JobsConfig's: their flags, help and defaults (config.option).


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples' line breaks and shows an option's default, where it has one that the help does not
    already say in words ("(default: None)" after "default: the hosts file the last up used" teaches nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Bad command lines become a ConfigError: one line, exit 2, like every other expected failure. No option is
    taken by a prefix of its name: `submit --gpus 0` would otherwise be `--gpus-per-node 0`, and a new option could
    change what an old command line means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self._command()} --help)")

    def _command(self) -> str:
        """This parser's command line head; for an option no command took (the top parser reports those), the
        command given, so that the hint points at the help that lists its options."""
        commands = [name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]
        return " ".join([self.prog, *(a for a in sys.argv[1:2] if a in commands)])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m orchestrate", formatter_class=_Formatter, epilog=EXAMPLES,
                     description="Train the DDP CIFAR-10 trainer on every GPU of every host listed in a hosts "
                                 "file, one container per node, over SSH and Docker.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    up = sub.add_parser("up", help="preflight, move image and data, start the job, watch it",
                        formatter_class=_Formatter, epilog=EXAMPLES,
                        description="Preflight every host (nothing starts unless all pass), send the image and "
                                    "the data where missing, start one container per node, stream the logs and "
                                    "stop everything if a node fails. Trainer options go after '--'.")
    _ssh_args(up, hosts_required=False, in_allocation=True)
    up.add_argument("-f", "--file", type=Path, default=None,
                    help="job file (TOML): any option of up by its long name, and args = [...] for the program; "
                         "the command line wins (see orchestrate/jobfile.py)")
    _section_args(up)
    up.add_argument("trainer_args", nargs="*", help="trainer options after --, e.g. -- --epochs 30")
    check = sub.add_parser("check", formatter_class=_Formatter,
                           help="first-day self-test: GPU probe, training steps and a checkpoint per node as the job "
                                "runs them, then the network within and between the hosts; one table for a bug report",
                           description="Preflight, send the image where missing, then per node: the GPU probe "
                                       "(skipped with --gpus 0); the job's processes under torchrun (one per GPU, "
                                       "at least 2 on CPU) taking a few training steps with the job's strategy and "
                                       "precision, and a checkpoint in the job's format saved and restored "
                                       "(trainer/selftest.py). Then the network check: all_reduce bus bandwidth "
                                       "among each node's processes, then over every process of every node "
                                       "(gloo on CPU, NCCL on GPU; 1 MB to --max-mb), then a ping-pong between "
                                       "every pair of nodes (up to 8 nodes), and the transport NCCL's log names. "
                                       "Exit 1 when a part failed, a node cannot take part, is an outlier (below "
                                       "half the median node's best pair), misses a floor, or NCCL used another "
                                       "network than the plan's. Trainer options after -- as for up "
                                       "(e.g. -- --strategy fsdp --batch-size 256).")
    _ssh_args(check, hosts_required=True)
    _check_args(check)
    for flag, (choices, what) in SELFTEST_OPTIONS.items():
        check.add_argument(flag, choices=choices, default=None,
                           help=f"of the self-test's training steps: {what}; default the trainer's, as for the job")
    check.add_argument("trainer_args", nargs="*", help="trainer options after --, as for up (they win)")
    for name, help_text in JOB_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        _ssh_args(p, hosts_required=False)
        _jobs_args(p, name)
    for name, summary in ((n, t) for s in ALLOCATORS for n, t in s.summaries.items()):
        # listed only: run() hands an allocator's subcommand its whole command line before this parser reads it
        sub.add_parser(name, help=summary, add_help=False)
    parser.up_parser = up  # type: ignore[attr-defined]  # the job file's schema (jobfile.py)
    return parser


def _ssh_args(p: argparse.ArgumentParser, hosts_required: bool, in_allocation: bool = False) -> None:
    """--hosts and the SSH options (SSHOptions' fields); --hosts's help adds the allocators' values and its
    default; `in_allocation`: an allocator's allocation this runs in is the default (up's)."""
    inside = "".join(f"{s.default_help}, else " for s in ALLOCATORS) if in_allocation else ""
    for f in dataclasses.fields(SSHOptions):
        help_text, extra = f.metadata["help"], {}
        if f.name == "hosts_file":
            help_text += "".join(f", or {s.hosts_help}" for s in ALLOCATORS) + (
                "" if hosts_required else f" (default: {inside}the hosts file the job's last up used)")
            extra = {"required": hosts_required}
        _argument(p, f, f.metadata["flag"], help_text, extra)


def _ssh_of(ns: argparse.Namespace) -> SSHOptions:
    """The SSH options parsed (every command takes them)."""
    return SSHOptions(**{f.name: getattr(ns, _dest(f.metadata["flag"])) for f in dataclasses.fields(SSHOptions)})


def _dest(flag: str) -> str:
    """Where argparse keeps an option's value: `--ssh-config` -> ssh_config."""
    return flag.lstrip("-").replace("-", "_")


def _env(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--env NAME=VALUE`, or `--env NAME`: the value this process's environment holds (as `docker run -e NAME`), so
    that a secret need not be on a command line (`submit` passes them so)."""
    out = []
    for number, pair in enumerate(pairs, start=1):
        name, sep, value = pair.partition("=")
        if not sep and pair in os.environ:
            value = os.environ[pair]
        elif not sep or not name:
            # Never echo the argument: a mistyped `--env HF_TOKEN:s3cr3t` holds a secret.
            raise ConfigError(f"--env number {number} has no NAME= and names no variable set here: write --env "
                              "NAME=VALUE, or --env NAME to pass this environment's value")
        out.append((name, value))
    return tuple(out)


# Parsed values that become more than one field, or another type (an option's metadata "parse").
PARSE: dict[str, Callable[[Any], dict[str, Any]]] = {
    "gpus": lambda value: dict(zip(("gpus", "gpu_ids"), split(value), strict=True)),
    "dry_run": lambda value: {"dry_run": value == "offline", "dry_run_hosts": value == "hosts"},
    "env": lambda value: {"env": _env(value)},
}
ARG_TYPES: dict[str, Callable[[str], Any]] = {"gpus": parse_gpus}  # the parser's type= by "parse"


def _options() -> list[tuple[str, type, dataclasses.Field[Any]]]:
    """(section name, section, field) of every option, in the sections' order."""
    return [(name, cls, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _argument(p: argparse._ActionsContainer, f: dataclasses.Field[Any], flag: str, help_text: str,
              extra: dict[str, Any]) -> None:
    kwargs = {k: v for k, v in {**f.metadata["cli"], **extra}.items() if k not in ("parse", "parser_default", "short")}
    parse = f.metadata["cli"].get("parse")
    if parse in ARG_TYPES:
        kwargs["type"] = ARG_TYPES[parse]
    if kwargs.get("action") != "store_true":
        # a field without a default is a required option: no default to show
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs["default"] = f.metadata["cli"].get("parser_default", default)
    short = f.metadata["cli"].get("short")
    p.add_argument(*((short,) if short else ()), flag, help=help_text, **kwargs)


def _section_args(up: argparse.ArgumentParser) -> None:
    """up's options, one group per config section."""
    for cls in SECTIONS.values():
        group = up.add_argument_group(cls.__doc__)
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag"):
                _argument(group, f, f.metadata["flag"], f.metadata["help"], {})


def _check_args(check: argparse.ArgumentParser) -> None:
    """check's options: the fields that name a flag of check (by default up's own, with up's help)."""
    for _, _, f in _options():
        flag = _flag(f, "check")
        if flag:
            spec = f.metadata["check"]
            extra = {k: v for k, v in spec.items() if k not in ("flag", "help")}
            _argument(check, f, flag, spec.get("help", f.metadata["help"]), extra)


def _jobs_args(p: argparse.ArgumentParser, command: str) -> None:
    """A job command's options: the JobsConfig fields that name it, each under its field's name."""
    for f in _jobs_fields(command):
        taken = f.metadata["commands"]
        _argument(p, f, f.metadata["flag"], taken[command] if isinstance(taken, dict) else f.metadata["help"],
                  {"dest": f.name})


def _jobs_fields(command: str) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(JobsConfig) if command in f.metadata.get("commands", ())]


def _flag(f: dataclasses.Field[Any], command: str) -> str | None:
    """The field's flag in `up` or `check` (None: not an option there)."""
    if command == "up":
        return f.metadata.get("flag")
    spec = f.metadata.get("check")
    return None if spec is None else spec.get("flag", f.metadata["flag"])


def _fields_of(ns: argparse.Namespace, command: str) -> dict[str, Any]:
    """The parsed options of up or check as config fields by name."""
    out: dict[str, Any] = {}
    for _, _, f in _options():
        flag = _flag(f, command)
        if flag:
            value = getattr(ns, _dest(flag))
            parse = f.metadata["cli"].get("parse")
            out.update(PARSE[parse](value) if parse else {f.name: value})
    return out


# A devcluster setting, not a user's option: `python -m devcluster up --gpus N` makes hosts whose nvidia-smi is
# simulated, and its clients' environment (devcluster/cluster.py client_env) says so with this variable set to 1.
# The job then holds its GPU set (labels, CUDA_VISIBLE_DEVICES) while its containers run on CPU.
GPUS_ON_CPU_ENV = "DEVCLUSTER_GPUS_ON_CPU"


def _gpus_on_cpu() -> bool:
    """The hosts' GPUs are CPU stand-ins: read here, where the config is composed, and nowhere else."""
    return os.environ.get(GPUS_ON_CPU_ENV) == "1"


def up_config(ns: argparse.Namespace) -> UpConfig:
    return UpConfig.of(_ssh_of(ns), **_fields_of(ns, "up"), gpus_on_cpu=_gpus_on_cpu(),
                       trainer_args=tuple(ns.trainer_args))


def check_config(ns: argparse.Namespace) -> UpConfig:
    return UpConfig.of(_ssh_of(ns), **_fields_of(ns, "check"), gpus_on_cpu=_gpus_on_cpu(),
                       trainer_args=(*_given(ns), *ns.trainer_args))


def _given(ns: argparse.Namespace) -> tuple[str, ...]:
    """check's trainer options (SELFTEST_OPTIONS), the ones given (the trainer's defaults are the job's)."""
    return tuple(arg for flag in SELFTEST_OPTIONS if getattr(ns, _dest(flag)) is not None
                 for arg in (flag, getattr(ns, _dest(flag))))


def jobs_config(ns: argparse.Namespace) -> JobsConfig:
    """The options the command took; the others keep their field's default."""
    return JobsConfig(ssh=_ssh_of(ns),
                      **{f.name: getattr(ns, f.name) for f in _jobs_fields(ns.command)})


def parse_args(argv: Sequence[str]) -> tuple[str, UpConfig | JobsConfig]:
    argv = list(argv)
    trainer: list[str] = []
    given_args = "--" in argv
    if "--" in argv:  # everything after -- goes to the trainer untouched
        cut = argv.index("--")
        argv, trainer = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "up":
        if ns.trainer_args:
            raise ConfigError(f"unexpected argument {ns.trainer_args[0]!r}; put trainer options after '--'")
        base = _job_base(ns, parser.up_parser)  # type: ignore[attr-defined]
        if base:  # the job file's (or the stored job's) options under the command line's
            file_args = list(base.pop("trainer_args", []))  # type: ignore[call-overload]
            parser.up_parser.set_defaults(**base)  # type: ignore[attr-defined]
            ns = parser.parse_args(argv)
            trainer = trainer if given_args else file_args
        if ns.hosts is None:  # an allocator's allocation this runs in, if any
            ns.hosts = next((hosts for s in ALLOCATORS if (hosts := s.default_hosts()) is not None), None)
        if ns.hosts is None:
            raise ConfigError("up needs the hosts: --hosts FILE, hosts = \"FILE\" in a job file (-f), or --job NAME "
                              "of a job that ran from here before")
        _allocation_hosts(ns)
        ns.trainer_args = trainer
        return "up", up_config(ns)
    if ns.command == "check":
        if ns.trainer_args:
            raise ConfigError(f"unexpected argument {ns.trainer_args[0]!r}; put trainer options after '--'")
        _allocation_hosts(ns)
        ns.trainer_args = trainer
        return "check", check_config(ns)
    if trainer:
        raise ConfigError(f"'{ns.command}' takes no trainer options after '--'")
    granted = _allocation(ns.hosts)
    if granted:
        ns.hosts = granted.hosts_file
    return ns.command, jobs_config(ns)


def _allocation(hosts: Path | None) -> Allocation | None:
    """--hosts naming an allocator's allocation: the one this runs in; None for a hosts file."""
    if hosts is None:
        return None
    from orchestrate.jobs import memory

    return next((found for s in ALLOCATORS if (found := s.allocation(hosts, memory.state_dir())) is not None), None)


def _allocation_hosts(ns: argparse.Namespace) -> None:
    """--hosts naming an allocator: the allocation's hosts file, and --gpus as it granted them (the hosts file's
    gpu_ids= holds each node's indices): a count given by hand must match the grant; --gpus 0 runs on CPU
    regardless."""
    granted = _allocation(ns.hosts)
    if granted:
        ns.hosts, ns.gpus = granted.hosts_file, granted.gpus(split(ns.gpus)[0])


class _CommandLine:
    """The CommandLine of backends/protocol.py: what an allocator's own subcommands (`submit`) borrow from here."""

    def parser(self, command: str, description: str, options: type[Any]) -> argparse.ArgumentParser:
        # No abbreviations: the options it does not know go on to `up`, and `--gpus` (up's) must not be taken for
        # an abbreviation of one of its own (`--gpus-per-node`).
        p = _Parser(prog=f"python -m orchestrate {command}", formatter_class=_Formatter, description=description,
                    allow_abbrev=False)
        for f in dataclasses.fields(options):
            if f.metadata.get("flag"):
                _argument(p, f, f.metadata["flag"], f.metadata["help"], {})
        return p

    def up_options(self, argv: Sequence[str]) -> argparse.Namespace:
        """up's options as `up` reads them: a job file's (-f) under the command line's; its `hosts =` aside (the
        allocator's allocation is the hosts), its args as `trainer_args`."""
        from orchestrate import jobfile

        parser = build_parser()
        ns = parser.parse_args(["up", *argv])
        if ns.trainer_args:
            raise ConfigError(f"unexpected argument {ns.trainer_args[0]!r}; put trainer options after '--'")
        if ns.file is None:
            return ns
        base = {k: v for k, v in jobfile.load(ns.file, parser.up_parser).items() if k != "hosts"}  # type: ignore[attr-defined]
        parser.up_parser.set_defaults(**base)  # type: ignore[attr-defined]
        return parser.parse_args(["up", *argv])

    def up_config(self, ns: argparse.Namespace, hosts: Path, trainer: Sequence[str]) -> UpConfig:
        ns.hosts, ns.trainer_args = hosts, list(trainer)
        return up_config(ns)

    def state_dir(self) -> Path:
        from orchestrate.jobs import memory

        return memory.state_dir()


COMMAND_LINE = _CommandLine()


def _job_base(ns: argparse.Namespace, up_parser: argparse.ArgumentParser) -> dict[str, object]:
    """Options under the command line's: the job file's (-f), or, without --hosts, the stored job of --job."""
    from orchestrate import jobfile
    from orchestrate.jobs import memory

    if ns.file is not None:
        return jobfile.load(ns.file, up_parser)
    if ns.hosts is None:
        stored = memory.load(ns.job)
        if stored is not None:
            return jobfile.from_state(stored, up_parser)
    return {}


def run(argv: Sequence[str], console: Console) -> int:
    """The command line is a thin layer over the Python API (orchestrate/api.py)."""
    from orchestrate import api

    allocator_commands = {name: command for s in ALLOCATORS for name, command in s.commands.items()}
    if argv[:1] and argv[0] in allocator_commands:  # an allocator's own subcommand (`submit`)
        cut = list(argv).index("--") if "--" in argv else len(argv)
        return allocator_commands[argv[0]](argv[1:cut], argv[cut + 1:], COMMAND_LINE, console)
    command, config = parse_args(argv)
    if isinstance(config, UpConfig):
        try:
            return api.up(config, console) if command == "up" else api.check(config, console)
        except MultiHostError as err:
            raise _with_hints(err, config) from None
    return api.jobs(command, config, console)


def _with_hints(err: MultiHostError, config: UpConfig) -> MultiHostError:
    """Hosts that failed inside an allocator's allocation: each line says what the site must allow."""
    from orchestrate.jobs import memory

    for s in ALLOCATORS:
        err = s.hint(err, config.ssh.hosts_file, memory.state_dir())
    return err


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its tracebacks duplicate our one-line errors
    console, err_console = console_for(), console_for(stderr=True)
    try:
        return run(sys.argv[1:] if argv is None else argv, console)
    except MultiHostError as err:
        err_console.print(f"error: {err.what} failed on {len(err.failures)} host(s):", markup=False, soft_wrap=True)
        for line in err.lines():
            err_console.print(f"  {line}", markup=False, soft_wrap=True)
        return err.exit_code
    except OrchestrateError as err:
        err_console.print(f"error: {err}", markup=False, soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted; the job's containers (if any started) are found by label: "
                          "'kill --job NAME' stops them", markup=False, soft_wrap=True)
        return 130
