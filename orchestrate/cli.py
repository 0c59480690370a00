"""Command line: `python -m orchestrate up | check | kill | status | logs | plot`.

argparse → one frozen, validated config per subcommand → one function per subcommand. Expected failures
(OrchestrateError) are caught here only, printed as one line (or one line per host), non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from orchestrate.config import (
    LAYER_CACHE_MODES,
    JobsConfig,
    SSHOptions,
    UpConfig,
)
from orchestrate.errors import ConfigError, MultiHostError, OrchestrateError
from orchestrate.plan.gpus import parse_gpus, split
from orchestrate.plan.transport import TRANSPORTS
from trainer.config import PRECISIONS
from trainer.config import Config as TrainerConfig
from trainer.contract import METRICS_FILE

EXAMPLES = """\
examples:
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 -- --epochs 30 --precision bf16
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 --dry-run -- --epochs 30
  python -m orchestrate status --job r18
  python -m orchestrate logs --job r18 -f --node 1
  python -m orchestrate plot --job r18 --out r18.png
  python -m orchestrate check --hosts hosts.txt --gpus 8
  python -m orchestrate kill --job r18
  python -m orchestrate up --hosts hosts.txt --gpus 8 --job r18 --resume -- --epochs 30 --precision bf16

hosts file: one host a line, [user@]host[:port] [slots=N] [key=value ...], '#' comments; the first host
is node 0 and the rendezvous master. Keys: slots, iface, docker_host, data_dir, ckpt_dir, log_dir.
Names resolve through ~/.ssh/config; host keys are checked against known_hosts.
"""


GPUS_HELP = ("GPUs per node: a number (Docker gives the first N), 'all' (-1), device indices (0,1,2,3 or 4-7; "
             "one GPU: 3-3), or 0 for CPU mode (gloo)")
TRANSPORT_HELP = ("NCCL between the nodes: ib = InfiniBand/RoCE (preflight refuses a node without an active port), "
                  "socket = TCP, auto = IB when every node has it")
# The defaults are the configs' own (config.py): written once, shown by --help, used by job files (jobfile.py).
UP: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(UpConfig)}
JOBS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(JobsConfig)}
TRAINER: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples' line breaks and shows every option's default."""


class _Parser(argparse.ArgumentParser):
    """Bad command lines become a ConfigError: one line, exit 2, like every other expected failure."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see python -m orchestrate {self.prog.split()[-1]} --help)")


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
    _ssh_args(up, hosts_required=False)
    up.add_argument("-f", "--file", type=Path, default=None,
                    help="job file (TOML): any option of up by its long name, and args = [...] for the program; "
                         "the command line wins (see orchestrate/jobfile.py)")
    up.add_argument("--job", default=UP["job"], help="job name (container names and labels)")
    up.add_argument("--image", default=UP["image"], help="image to run; sent to nodes that lack it")
    up.add_argument("--entry", default=UP["entry"],
                    help="program torchrun starts: '-m pkg.module' or a script path inside the image; "
                         "its arguments go after --")
    up.add_argument("--gpus", type=parse_gpus, default=UP["gpus"], help=GPUS_HELP)
    up.add_argument("--nccl-transport", choices=TRANSPORTS, default=UP["nccl_transport"], help=TRANSPORT_HELP)
    up.add_argument("--nproc-per-node", type=int, default=None, help="processes per node (default: GPUs, or 1 on CPU)")
    up.add_argument("--master-addr", default=None, help="rendezvous address (default: node 0's address)")
    up.add_argument("--master-port", type=int, default=UP["master_port"],
                    help="rendezvous port on node 0 (default: one free there and held by no other job)")
    up.add_argument("--gpus-on-cpu", action="store_true",
                    help="hold the GPUs of --gpus (labels, CUDA_VISIBLE_DEVICES) but run on CPU: for test hosts "
                         "whose nvidia-smi is simulated (python -m devcluster up --gpus N)")
    up.add_argument("--data-dir", default=UP["data_dir"], help="CIFAR-10 on each node (data_dir= per host wins)")
    up.add_argument("--ckpt-dir", default=UP["ckpt_dir"], help="{job} expands to the job name")
    up.add_argument("--log-dir", default=UP["log_dir"],
                    help="per-rank stdout/stderr files on each node (read one with 'logs --rank R')")
    up.add_argument("--data-url", default=UP["data_url"], help="archive each node downloads")
    up.add_argument("--data-from", type=Path, default=None,
                    help="a local folder synced into every node's data dir (only changed files move), or the "
                         "CIFAR-10 archive to send instead of downloading (another program: any single file)")
    up.add_argument("--data-md5", default=UP["data_md5"], help="expected md5 of the archive")
    up.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeat)")
    up.add_argument("--pull", action="store_true", help="pull the image on the nodes instead of sending it")
    up.add_argument("--layer-cache", choices=LAYER_CACHE_MODES, default=UP["layer_cache"],
                    help="where the layers a node lacks are read here: 'on' = the local layer cache (docker push into "
                         "a docker-registry on loopback, ~/.cache/ddp-cifar/layers: only new layers are compressed), "
                         "'off' = one docker save stream (the whole image is read every time), 'auto' = on when "
                         "docker-registry is installed, else off")
    up.add_argument("--detach", action="store_true", help="return once every container runs")
    up.add_argument("--dry-run", nargs="?", const="offline", choices=("offline", "hosts"), default=None,
                    help="print the plan and touch nothing: offline (contacts nothing; the default), or =hosts "
                         "(connects and probes every host read-only: folders, image and data actions, leftovers, "
                         "the docker run line, the resume step)")
    up.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON (docs/orchestrate.md)")
    up.add_argument("--timings", action="store_true", help="print each phase's time (seconds) at the end")
    up.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    up.add_argument("--replace", action="store_true", help="stop a running job of the same name first")
    up.add_argument("--stop-on-interrupt", action="store_true", help="Ctrl-C stops the job without asking")
    up.add_argument("--min-free-gb", type=float, default=UP["min_free_gb"], help="free disk each node needs under its dirs")
    up.add_argument("--shm-size", default=None, help="a sized /dev/shm instead of --ipc=host")
    up.add_argument("--memory", default=None,
                    help="memory limit of each node's container, e.g. 24g (docker run --memory, no swap beyond it): "
                         "one job cannot take a shared host down; a container over it is OOM-killed (reported)")
    up.add_argument("--grace", type=float, default=UP["grace"], help="seconds between SIGTERM and SIGKILL")
    heal = up.add_argument_group("self-healing (README: What happens when...)")
    heal.add_argument("--max-restarts", type=int, default=UP["max_restarts"],
                      help="after a failure (a node exits non-zero, is OOM-killed, stops answering or stalls), "
                           "stop everywhere and start again from the newest valid checkpoint, up to N times")
    heal.add_argument("--min-nodes", type=int, default=None,
                      help="at a restart, leave out hosts that fail preflight while this many remain "
                           "(default: every host); the global batch stays the run's own")
    heal.add_argument("--stall-timeout", type=float, default=UP["stall_timeout"],
                      help="seconds without a new training step (rank 0's heartbeat) before the job counts as "
                           "stalled: stack dumps of every rank, then stop (and restart); at least 3x the slowest "
                           "step seen; 0: off")
    heal.add_argument("--ckpt-mirror", type=Path, default=None,
                      help="also copy each new checkpoint into this folder on this machine (it is always copied "
                           "to node 1 too, when there is one)")
    up.add_argument("--check-network", action="store_true",
                    help="after preflight, measure the network between the nodes (as 'check' does) and start "
                         "nothing if a node cannot take part; an outlier is named")
    up.add_argument("--check-max-mb", type=int, default=UP["check_max_mb"], help="largest message of --check-network (MB)")
    up.add_argument("trainer_args", nargs="*", help="trainer options after --, e.g. -- --epochs 30")
    check = sub.add_parser("check", formatter_class=_Formatter,
                           help="first-day self-test: GPU probe, a training step and a checkpoint per node, then "
                                "the network between the hosts; one table for a bug report",
                           description="Preflight, send the image where missing, then per node: the GPU probe "
                                       "(skipped with --gpus 0), a few training steps of the trainer's model with "
                                       "--precision and a checkpoint saved and loaded (trainer/selftest.py). Then "
                                       "one container per node runs an all_reduce bandwidth test with the job's network settings "
                                       "(gloo on CPU, NCCL on GPU; 1 MB to --max-mb), then a ping-pong between "
                                       "every pair of nodes (up to 8 nodes). Prints GB/s per node and per pair "
                                       "and names a node whose best pair is below half the median node's. "
                                       "Exit 1 when a part failed, a node cannot take part or is an outlier.")
    _ssh_args(check, hosts_required=True)
    check.add_argument("--job", default=UP["job"], help="the job whose settings to use (containers JOB-netcheck-*)")
    check.add_argument("--image", default=UP["image"], help="image to run it in (any image with torch)")
    check.add_argument("--gpus", type=parse_gpus, default=UP["gpus"], help=GPUS_HELP)
    check.add_argument("--nccl-transport", choices=TRANSPORTS, default=UP["nccl_transport"], help=TRANSPORT_HELP)
    check.add_argument("--master-addr", default=None, help="rendezvous address (default: node 0's address)")
    check.add_argument("--master-port", type=int, default=UP["master_port"],
                       help="rendezvous port on node 0 (default: one free there and held by no other job)")
    check.add_argument("--max-mb", type=int, default=UP["check_max_mb"], help="largest message (MB)")
    check.add_argument("--precision", choices=PRECISIONS, default="bf16",
                       help="of the self-test's training steps (fp16 runs with a gradient scaler)")
    check.add_argument("--model", default=TRAINER["model"],
                       help="of the self-test's training steps: the job's model (e.g. tiny for a quick check on CPU)")
    for name, help_text in (("kill", "stop and remove the job's containers"),
                            ("status", "one row per node, the job's progress and restarts"),
                            ("logs", "print or follow the nodes' logs"),
                            ("plot", f"draw the job's {METRICS_FILE} (from node 0): loss, accuracy, images/s, "
                                     "learning rate against step, restarts marked")):
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        _ssh_args(p, hosts_required=False)
        p.add_argument("--job", default=JOBS["job"], help="job name")
        if name == "kill":
            p.add_argument("--grace", type=float, default=JOBS["grace"], help="seconds between SIGTERM and SIGKILL")
        if name == "logs":
            p.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")
            p.add_argument("--node", type=int, default=None, help="only this node rank")
            p.add_argument("--tail", type=int, default=JOBS["tail"], help="last N lines per node (0: all)")
            p.add_argument("--rank", type=int, default=None,
                           help="one global rank's stdout/stderr files (from up's --log-dir on its node)")
        if name == "status":
            p.add_argument("--all", action="store_true", dest="all_jobs",
                           help="every job on the hosts, everyone's: owner, name, nodes, GPUs, age")
        if name == "plot":
            p.add_argument("--out", type=Path, default=None, help="PNG to write (default: JOB-metrics.png here)")
    parser.up_parser = up  # type: ignore[attr-defined]  # the job file's schema (jobfile.py)
    return parser


def _ssh_args(p: argparse.ArgumentParser, hosts_required: bool) -> None:
    p.add_argument("--hosts", type=Path, required=hosts_required, default=None,
                   help="hosts file" + ("" if hosts_required else " (default: the one the job's last up used)"))
    p.add_argument("--ssh-config", type=Path, default=None, help="default ~/.ssh/config")
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust unknown host keys on first use (adds them to known_hosts); changed keys stay refused")


def _env(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for number, pair in enumerate(pairs, start=1):
        name, sep, value = pair.partition("=")
        if not sep or not name:
            # Never echo the argument: a mistyped `--env HF_TOKEN:s3cr3t` holds a secret.
            raise ConfigError(f"--env number {number} has no NAME=: write --env NAME=VALUE")
        out.append((name, value))
    return tuple(out)


def _gpu_fields(value: int | Sequence[int]) -> dict[str, Any]:
    """--gpus as the config holds it: a count, and the device indices when they were given."""
    count, ids = split(value)
    return {"gpus": count, "gpu_ids": ids}


def up_config(ns: argparse.Namespace) -> UpConfig:
    return UpConfig(
        ssh=SSHOptions(ns.hosts, ns.ssh_config, ns.accept_new_host_keys), job=ns.job, image=ns.image,
        **_gpu_fields(ns.gpus), gpus_on_cpu=ns.gpus_on_cpu, nccl_transport=ns.nccl_transport,
        nproc_per_node=ns.nproc_per_node, master_addr=ns.master_addr,
        master_port=ns.master_port, data_dir=ns.data_dir, ckpt_dir=ns.ckpt_dir, log_dir=ns.log_dir,
        data_url=ns.data_url, data_from=ns.data_from, data_md5=ns.data_md5, env=_env(ns.env), pull=ns.pull, layer_cache=ns.layer_cache,
        detach=ns.detach, dry_run=ns.dry_run == "offline", dry_run_hosts=ns.dry_run == "hosts", as_json=ns.json,
        timings=ns.timings, resume=ns.resume, replace=ns.replace,
        stop_on_interrupt=ns.stop_on_interrupt, min_free_gb=ns.min_free_gb, shm_size=ns.shm_size, memory=ns.memory, grace=ns.grace,
        trainer_args=tuple(ns.trainer_args), entry=ns.entry, max_restarts=ns.max_restarts,
        min_nodes=ns.min_nodes, stall_timeout=ns.stall_timeout, ckpt_mirror=ns.ckpt_mirror,
        check_network=ns.check_network, check_max_mb=ns.check_max_mb,
    )


def check_config(ns: argparse.Namespace) -> UpConfig:
    return UpConfig(ssh=SSHOptions(ns.hosts, ns.ssh_config, ns.accept_new_host_keys), job=ns.job, image=ns.image,
                    **_gpu_fields(ns.gpus), nccl_transport=ns.nccl_transport, master_addr=ns.master_addr,
                    master_port=ns.master_port, check_max_mb=ns.max_mb,
                    trainer_args=("--precision", ns.precision, "--model", ns.model))


def jobs_config(ns: argparse.Namespace) -> JobsConfig:
    return JobsConfig(ssh=SSHOptions(ns.hosts, ns.ssh_config, ns.accept_new_host_keys), job=ns.job,
                      grace=float(getattr(ns, "grace", JOBS["grace"])), follow=getattr(ns, "follow", False),
                      node=getattr(ns, "node", None), tail=int(getattr(ns, "tail", JOBS["tail"])),
                      rank=getattr(ns, "rank", None), out=getattr(ns, "out", None),
                      all_jobs=getattr(ns, "all_jobs", False))


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
        if ns.hosts is None:
            raise ConfigError("up needs the hosts: --hosts FILE, hosts = \"FILE\" in a job file (-f), or --job NAME "
                              "of a job that ran from here before")
        ns.trainer_args = trainer
        return "up", up_config(ns)
    if trainer:
        raise ConfigError(f"'{ns.command}' takes no trainer options after '--'")
    if ns.command == "check":
        return "check", check_config(ns)
    return ns.command, jobs_config(ns)


def _job_base(ns: argparse.Namespace, up_parser: argparse.ArgumentParser) -> dict[str, object]:
    """Options under the command line's: the job file's (-f), or, without --hosts, the stored job of --job."""
    from orchestrate import jobfile
    from orchestrate.jobs import memory as state

    if ns.file is not None:
        return jobfile.load(ns.file, up_parser)
    if ns.hosts is None:
        stored = state.load(ns.job)
        if stored is not None:
            return jobfile.from_state(stored, up_parser)
    return {}


def run(argv: Sequence[str], console: Console) -> int:
    """The command line is a thin layer over the Python API (orchestrate/api.py)."""
    from orchestrate import api

    command, config = parse_args(argv)
    if isinstance(config, UpConfig):
        return api.up(config, console) if command == "up" else api.check(config, console)
    return api.jobs(command, config, console)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its tracebacks duplicate our one-line errors
    # Wide output when piped (logs, CI): tables and long error lines stay on one line each.
    # emoji=False: an image tag such as ":new" before a colon would print as an emoji
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 200)
    err_console = Console(stderr=True, highlight=False, emoji=False, width=None if sys.stderr.isatty() else 400)
    try:
        return run(sys.argv[1:] if argv is None else argv, console)
    except MultiHostError as err:
        err_console.print(f"error: {err.what} failed on {len(err.failures)} host(s):", markup=False)
        for line in err.lines():
            err_console.print(f"  {line}", markup=False, soft_wrap=True)
        return err.exit_code
    except OrchestrateError as err:
        err_console.print(f"error: {err}", markup=False, soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted; the job's containers (if any started) are found by label: "
                          "'kill --job NAME' stops them", markup=False)
        return 130
