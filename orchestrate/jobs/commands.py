"""kill / status / logs / plot: hosts from --hosts or the job's remembered state, reached through the scheduler
(which owns the connection), then its answers, shown here."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrate.backends.protocol import Allocator, Reached, Scheduler
from orchestrate.config import JobsConfig
from orchestrate.errors import ConfigError, JobError, MultiHostError
from orchestrate.hosts import Host, parse_hosts_file
from orchestrate.jobs import memory, tensorboard
from orchestrate.loglines import follow_lines, print_lines, shown
from orchestrate.masking import mask_text
from orchestrate.plan.jobplan import CKPT_MOUNT

NodesT = TypeVar("NodesT")  # the scheduler's connection to the hosts, opaque here


def hosts_for(config: JobsConfig) -> list[Host]:
    if config.ssh.hosts_file is not None:
        return parse_hosts_file(config.ssh.hosts_file, config.ssh.ssh_config)
    remembered = memory.load(config.job)
    if remembered is None:
        raise ConfigError(f"no record of job {config.job!r} in {memory.state_dir()}; give --hosts FILE")
    ssh_config = config.ssh.ssh_config or remembered.ssh_config
    return parse_hosts_file(remembered.hosts_file, ssh_config)


def run_jobs_command(command: str, config: JobsConfig, console: Console, scheduler: Scheduler[NodesT],
                     allocators: Sequence[Allocator]) -> int:
    """`scheduler`: the one the composition root chose (api.py): it reaches the hosts, finds the job's containers
    and answers; `allocators`: the registered ones (backends/allocators.py), asked first about the job."""
    if _allocated(command, config, console, allocators) and config.ssh.hosts_file is None and memory.load(config.job) is None:
        return 0  # queued by an allocator, never started: no hosts, no containers yet
    with scheduler.reach(hosts_for(config), config.ssh) as reached:
        return _on_hosts(command, scheduler, reached, config, console)


def _on_hosts(command: str, scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: JobsConfig,
              console: Console) -> int:
    nodes, unreachable = reached.nodes, reached.unreachable
    if command == "kill":
        kill(scheduler, reached, config, console)
        return 0
    if command == "status":
        ok = (print_all_jobs(scheduler, nodes, console, unreachable) if config.all_jobs
              else print_status(scheduler, nodes, config.job, console, unreachable))
        if not ok:
            raise MultiHostError("status", unreachable)
        return 0
    if not reached.answered:  # "no container found" would hide that no host answered at all
        raise MultiHostError(command, unreachable)
    if command in ("plot", "tensorboard"):
        return _from_node0(command, scheduler, reached, config, console)
    if config.rank is not None:
        print_rank_logs(scheduler, nodes, config, console, config.rank)
    else:
        print_logs(scheduler, nodes, config, console)
    if unreachable:
        raise MultiHostError("logs", unreachable)
    return 0


def _from_node0(command: str, scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: JobsConfig,
                console: Console) -> int:
    """plot and tensorboard, which read node 0's folder: where it was not found, the hosts that did not answer are
    named (node 0 may be on one of them)."""
    try:
        return (plot if command == "plot" else tensorboard.run)(scheduler, reached, config, console)
    except JobError as err:
        if not reached.unreachable:
            raise
        raise JobError(f"{err}; no answer from {', '.join(sorted(reached.unreachable))}") from None


def _allocated(command: str, config: JobsConfig, console: Console, allocators: Sequence[Allocator]) -> bool:
    """status and kill of one job: each allocator's side first (its state printed; its queued or running jobs of the
    name cancelled). True when one of them knows the job."""
    if command not in ("status", "kill") or config.all_jobs:
        return False
    folder = memory.state_dir()
    known = [s.describe_job(config.job, console, folder) if command == "status"
             else s.cancel_job(config.job, console, folder) for s in allocators]
    return any(known)


def print_status(scheduler: Scheduler[NodesT], nodes: NodesT, job: str, console: Console, unreachable: dict[str, str]) -> bool:
    """Print one row per node, then the job's progress and its automatic restarts; False if some host could not be
    reached."""
    status = scheduler.describe(nodes, job, unreachable)
    table = Table(title=f"job {job}")
    # Every cell stays whole (grep finds it) and the table fits 100 columns (a file's width, orchestrate/terminal.py):
    # the exit code goes with the state, the checkpoint is its file name (the folder is the job's), and each node's
    # last log line, the one long text, follows the table on a line of its own.
    for col in ("node", "host", "container", "state", "uptime", "checkpoint"):
        table.add_column(col, no_wrap=True)
    for row in status.rows:
        state = row.state if row.exit == "-" else f"{row.state} ({row.exit})"
        cells = (row.node, row.host, row.name, state, row.uptime, row.checkpoint)
        table.add_row(*(Text(cell) for cell in cells))  # Text: names are not markup
    console.print(table)
    for row in status.rows:
        console.print(f"node {row.node} last log line: {row.last_line}", markup=False, highlight=False)
    for line in status.lines:
        console.print(line, markup=False, highlight=False)
    return not unreachable


def print_all_jobs(scheduler: Scheduler[NodesT], nodes: NodesT, console: Console, unreachable: Mapping[str, str]) -> bool:
    """`status --all`: every owner's jobs on the reachable hosts, one row each; False if a host was unreachable."""
    table = Table(title="jobs on these hosts (everyone's)")
    for col in ("owner", "job", "nodes", "GPUs", "age", "running"):
        table.add_column(col, overflow="fold", no_wrap=col != "GPUs")  # names stay whole; a long GPU list folds
    for row in scheduler.find(nodes):
        table.add_row(*(Text(cell) for cell in (row.owner, row.job, row.nodes, row.gpus, row.age,
                                                 f"{row.running}/{row.containers}")))
    console.print(table)
    for label, why in sorted(unreachable.items()):
        console.print(f"{label}: UNREACHABLE ({why[:80]})", markup=False, highlight=False)
    return not unreachable


def print_logs(scheduler: Scheduler[NodesT], nodes: NodesT, config: JobsConfig, console: Console) -> None:
    """Print (or follow) the nodes' logs, each line prefixed with its node rank."""
    logs = scheduler.logs(nodes, config.job, config.node, config.tail, config.follow)
    if not config.follow:
        for log in logs:
            print_lines(console, log.node, b"".join(log.chunks).decode(errors="replace"), log.secrets)
        return
    threads = [threading.Thread(target=follow_lines, args=(console, log.node, log.chunks, log.secrets), daemon=True)
               for log in logs]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # joined in slices: Ctrl-C ends `logs -f` at once
        for t in threads:
            t.join(0.5)


def print_rank_logs(scheduler: Scheduler[NodesT], nodes: NodesT, config: JobsConfig, console: Console, rank: int) -> None:
    """One global rank's stdout and stderr files, then with --follow its new lines as they come."""
    found = scheduler.rank_logs(nodes, config.job, rank, config.tail, config.follow)
    for stream in ("stdout", "stderr"):
        for line in found.files.get(stream, "").splitlines():
            console.print(f"[rank {rank} {stream}] {mask_text(line, found.secrets)}", markup=False, highlight=False,
                          soft_wrap=True)
    for line in found.follow or ():
        console.print(f"[rank {rank}] {shown(mask_text(line, found.secrets))}", markup=False, highlight=False,
                      soft_wrap=True)


def kill(scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: JobsConfig, console: Console) -> None:
    """The stop record first, on every host (an `up` waiting to restart the job, from any machine, then starts
    nothing more: see jobs/stops.py), then the job's containers. A host where either fails is reported."""
    nodes = reached.nodes
    not_left = scheduler.leave_stop_record(nodes, config.job)
    left = len(reached.answered) - len(not_left)
    if left:
        console.print(f"left a stop record on {left} host(s): an 'up' of job {config.job!r} waiting to restart it "
                      "starts nothing more", markup=False, highlight=False)
    scheduler.cancel(nodes, config.job, config.grace, console, {**reached.unreachable, **not_left})


def plot(scheduler: Scheduler[NodesT], reached: Reached[NodesT], config: JobsConfig, console: Console) -> int:
    """metrics.jsonl from node 0, drawn locally (trainer.plot: matplotlib, no torch)."""
    import posixpath

    from trainer.contract import METRICS_FILE
    from trainer.plot import PlotError, plot_text

    remembered = memory.load(config.job)
    host, folder = scheduler.node0_dir(reached.nodes, config.job,
                                     remembered.options.get("ckpt_dir") if remembered else None, CKPT_MOUNT)
    path = posixpath.join(folder, METRICS_FILE)
    try:
        text = scheduler.read_file(reached.nodes, host, path).decode(errors="replace")
    except OSError:
        raise JobError(f"no {METRICS_FILE} of job {config.job!r} at {reached.label(host)}:{path} (the "
                       "trainer writes one record per epoch; another program may write none)") from None
    out = config.out or Path(f"{config.job}-metrics.png")
    try:
        plot_text(text, out, f"job {config.job}", f"{reached.label(host)}:{path}")
    except PlotError as err:
        raise JobError(str(err)) from None
    console.print(f"wrote {out} (from {reached.label(host)}:{path})", markup=False, highlight=False)
    return 0
