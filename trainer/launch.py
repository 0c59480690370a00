"""One process a node without torchrun's agent: ``python -m trainer.launch`` takes the torchrun options the
orchestrator passes (docs/DESIGN.md §7) and starts the program as torchrun would for ``--nproc_per_node 1``.

Why: torchrun's agent imports torch (about a CPU-second and a second of wall time a node start) to supervise one
process that the container's init, Docker and the orchestrator's watcher supervise already. The orchestrator uses
this launcher only when every node of the job runs one process and the image has it (orchestrate/plan/jobplan.py);
otherwise torchrun. What the program sees is what torchrun gives it: the same environment (RANK, LOCAL_RANK,
WORLD_SIZE, ... with rank r on node r; rank 0 hosts the rendezvous store that torchrun's agent would), the same
per-rank log files (``<log-dir>/<run>/attempt_0/0/stdout.log``, ``stderr.log``) and the same ``[default0]:``
lines on the container's log. Signals the container gets go to the program; its exit code is the launcher's.

Standard library only: it runs before anything imports torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

RUN_ID = "none"  # torchrun's default --rdzv-id: the run folder's prefix and TORCHELASTIC_RUN_ID
PREFIX = b"[default0]:"  # torchrun's --tee prefix for local rank 0 of the "default" role
DRAIN_S = 10  # after the program's exit, how long its streams' last lines are waited for
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)


def parse(argv: list[str]) -> argparse.Namespace:
    """The subset of torchrun's options the orchestrator passes; anything else is refused (exit 2)."""
    p = argparse.ArgumentParser(prog="python -m trainer.launch",
                                description="torchrun's start of one process a node, without its agent")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node_rank", "--node-rank", type=int, required=True)
    p.add_argument("--master_addr", "--master-addr", required=True)
    p.add_argument("--master_port", "--master-port", type=int, required=True)
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, required=True)
    p.add_argument("--log-dir", "--log_dir", type=Path, required=True)
    p.add_argument("--redirects", default="3", choices=["3"], help="as torchrun's: both streams to files")
    p.add_argument("--tee", default="3", choices=["3"], help="as torchrun's: both streams on the console too")
    p.add_argument("-m", "--module", action="store_true", help="the program is a module, as python -m")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc_per_node != 1:
        p.error(f"--nproc_per_node {args.nproc_per_node}: this launcher starts one process a node; use torchrun")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node_rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    return args


def worker_env(args: argparse.Namespace, error_file: Path) -> dict[str, str]:
    """torchrun's worker environment for one process a node (torch/distributed/elastic/agent/server/
    local_elastic_agent.py). No TORCHELASTIC_USE_AGENT_STORE: there is no agent, so rank 0's process group hosts
    the store at MASTER_ADDR:MASTER_PORT (env://)."""
    rank, nnodes = str(args.node_rank), str(args.nnodes)
    return {**os.environ, "RANK": rank, "GROUP_RANK": rank, "ROLE_RANK": rank, "ROLE_NAME": "default",
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": nnodes, "GROUP_WORLD_SIZE": nnodes,
            "ROLE_WORLD_SIZE": nnodes, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": RUN_ID,
            "TORCHELASTIC_ERROR_FILE": str(error_file)}


def rank_folder(log_dir: Path) -> Path:
    """A new run folder with torchrun's layout: <log-dir>/<run id>_<random>/attempt_0/0."""
    log_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{RUN_ID}_", dir=log_dir)) / "attempt_0" / "0"
    folder.mkdir(parents=True)
    return folder


def tee(source: IO[bytes], file: Path, console: IO[bytes]) -> None:
    """Each line of the program's stream into its file as written and onto the console with torchrun's prefix."""
    with file.open("ab") as out:
        for line in iter(source.readline, b""):
            out.write(line)
            out.flush()
            console.write(PREFIX + line + (b"" if line.endswith(b"\n") else b"\n"))
            console.flush()


def main(argv: list[str]) -> int:
    args = parse(argv)
    folder = rank_folder(args.log_dir)
    head = [sys.executable, "-u", *(["-m"] if args.module else [])]
    children: list[subprocess.Popen[bytes]] = []
    early: list[int] = []  # a signal before the program exists is sent to it once it does

    def forward(signum: int, _frame: object) -> None:
        for c in children:
            c.send_signal(signum)
        if not children:
            early.append(signum)

    for sig in FORWARDED:  # docker stop's SIGTERM reaches this process (tini, then the entrypoint's exec)
        signal.signal(sig, forward)
    child = subprocess.Popen([*head, args.training_script, *args.training_script_args], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=worker_env(args, folder / "error.json"))
    children.append(child)
    for signum in early:
        child.send_signal(signum)
    assert child.stdout is not None and child.stderr is not None
    threads = [threading.Thread(target=tee, args=(child.stdout, folder / "stdout.log", sys.stdout.buffer), daemon=True),
               threading.Thread(target=tee, args=(child.stderr, folder / "stderr.log", sys.stderr.buffer), daemon=True)]
    for t in threads:
        t.start()
    code = child.wait()
    drained_by = time.monotonic() + DRAIN_S  # a process the program left behind (a loader's worker) may hold them
    for t in threads:
        t.join(timeout=max(0.0, drained_by - time.monotonic()))
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention, as Docker reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
