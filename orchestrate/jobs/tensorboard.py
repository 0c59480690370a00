"""`tensorboard --job NAME`: the job's TensorBoard event files, fetched from node 0's log dir (and its replica's,
node 1, where a run that had it as node 0 left some) into a local folder, and TensorBoard started on it; the
files are fetched again every REFRESH_S while it serves. Without TensorBoard installed here, the folder is
printed. The trainer's rank 0 writes them into $LOG_DIR/tensorboard/; a program under --entry that writes event
files anywhere under $LOG_DIR gets the same."""

from __future__ import annotations

import importlib.util
import posixpath
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import TypeVar

from rich.console import Console

from orchestrate.backends.protocol import Reached, Scheduler
from orchestrate.config import JobsConfig
from orchestrate.errors import JobError
from orchestrate.jobs import memory
from orchestrate.localfs import end_child, write_atomically
from orchestrate.plan.jobplan import LOG_MOUNT
from trainer.contract import ENV_LOG_DIR, TENSORBOARD_EVENTS_PREFIX, TENSORBOARD_FOLDER

REFRESH_S = 30.0  # while TensorBoard serves, the event files are fetched again this often (a running job's grow)
START_S = 120.0  # TensorBoard's start (it imports its plugins: seconds on a loaded machine) is waited for this long
_URL = re.compile(r"TensorBoard \S+ at (http://\S+)")
NodesT = TypeVar("NodesT")  # the scheduler's connection to the hosts, opaque here


def within(found: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """PURE: the (path under the log dir, bytes) of `found` that stay inside the local folder: a path that
    could leave it (absolute, `..`), whatever a host answered, is left out."""
    return [(name, size) for name, size in found
            if not PurePosixPath(name).is_absolute() and ".." not in PurePosixPath(name).parts]


def fetch(scheduler: Scheduler[NodesT], nodes: NodesT, folders: dict[int, tuple[int, str]], out: Path) -> int:
    """Copy each node's event files that are new or changed into out/node<N>/; the number of files copied."""
    copied = 0
    for node, (host, folder) in sorted(folders.items()):
        for name, size in within(scheduler.files_named(nodes, host, folder, TENSORBOARD_EVENTS_PREFIX)):
            local = out / f"node{node}" / name
            if local.is_file() and local.stat().st_size == size:
                continue
            data = scheduler.read_file(nodes, host, posixpath.join(folder, name))
            write_atomically(local, [data])  # never half a file read
            copied += 1
    return copied


def log_folders(scheduler: Scheduler[NodesT], nodes: NodesT, config: JobsConfig) -> dict[int, tuple[int, str]]:
    """Node 0's log dir (from its container, or the options of the job's last `up` once it is removed) and node
    1's, the replica, when its container is there."""
    found = scheduler.node_dirs(nodes, config.job, LOG_MOUNT)
    remembered = memory.load(config.job)
    folders = {0: scheduler.node0_dir(nodes, config.job, remembered.options.get("log_dir") if remembered else None, LOG_MOUNT)}
    if 1 in found:
        folders[1] = found[1]
    return folders


def run(scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: JobsConfig, console: Console) -> int:
    folders = log_folders(scheduler, reached.nodes, config)
    out = config.out or Path(f"{config.job}-tensorboard")
    copied = fetch(scheduler, reached.nodes, folders, out)
    if not any(out.rglob(f"{TENSORBOARD_EVENTS_PREFIX}*")):
        where = ", ".join(f"{reached.label(h)}:{f}" for h, f in folders.values())
        raise JobError(f"no TensorBoard event files of job {config.job!r} under {where} (the trainer's rank 0 "
                       f"writes them into ${ENV_LOG_DIR}/{TENSORBOARD_FOLDER}; a program under --entry writes its own "
                       f"under ${ENV_LOG_DIR})")
    say(console, f"fetched {copied} event file(s) into {out}")
    if importlib.util.find_spec("tensorboard") is None:
        say(console, f"TensorBoard is not installed here: pip install tensorboard, then tensorboard --logdir {out}")
        return 0
    serve(scheduler, reached.nodes, folders, out, config.port, console)
    return 0


def say(console: Console, line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def serve(scheduler: Scheduler[NodesT], nodes: NodesT, folders: dict[int, tuple[int, str]], out: Path, port: int | None,
          console: Console) -> None:
    """TensorBoard on `out` (its own CLI, a child process) until Ctrl-C or SIGTERM; the event files fetched again
    every REFRESH_S meanwhile. The child is stopped on the way out, whatever ends the wait."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda _s, _f: stop.set())
    child = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "localhost",
                              *(["--port", str(port)] if port else [])],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        say(console, f"TensorBoard at {started_url(child)} on {out} (the event files fetched again every "
                     f"{REFRESH_S:.0f} s; Ctrl-C stops it)")
        wait_refreshing(scheduler, nodes, folders, out, child, stop, console)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        end_child(child)
    say(console, "TensorBoard stopped")


def started_url(child: subprocess.Popen[str]) -> str:
    """The URL TensorBoard prints once it serves; JobError when it exits first or says nothing in START_S."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()  # reads on after the URL: the pipe never fills
    seen: list[str] = []
    deadline = time.monotonic() + START_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        found = _URL.search(line)
        if found:
            return found.group(1)
        seen.append(line.strip())
    raise JobError(f"TensorBoard did not start: {(seen or ['no output within the wait'])[-1]}")


def wait_refreshing(scheduler: Scheduler[NodesT], nodes: NodesT, folders: dict[int, tuple[int, str]], out: Path,
                    child: subprocess.Popen[str], stop: threading.Event, console: Console) -> None:
    while not stop.wait(REFRESH_S):
        if child.poll() is not None:
            raise JobError(f"TensorBoard exited with code {child.returncode}")
        try:
            fetch(scheduler, nodes, folders, out)
        except Exception as err:  # noqa: BLE001  # a node gone meanwhile: what was fetched stays served
            say(console, f"warning: event files not fetched again: {err}")

