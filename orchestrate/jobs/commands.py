"""kill / status / logs wiring: hosts from --hosts or the job's remembered state, then jobs.py."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from orchestrate.config import JobsConfig
from orchestrate.errors import ConfigError, JobError, MultiHostError
from orchestrate.hosts import Host, parse_hosts_file
from orchestrate.jobs import memory as state
from orchestrate.jobs import stops
from orchestrate.jobs.control import kill_job, node0_ckpt_dir, print_status, rank_logs, stream_logs
from orchestrate.jobs.owner import print_all_jobs
from orchestrate.remote.session import Nodes


def hosts_for(config: JobsConfig) -> list[Host]:
    if config.ssh.hosts_file is not None:
        return parse_hosts_file(config.ssh.hosts_file, config.ssh.ssh_config)
    remembered = state.load(config.job)
    if remembered is None:
        raise ConfigError(f"no record of job {config.job!r} in {state.state_dir()}; give --hosts FILE")
    ssh_config = config.ssh.ssh_config or remembered.ssh_config
    return parse_hosts_file(remembered.hosts_file, ssh_config)


def run_jobs_command(command: str, config: JobsConfig, console: Console) -> int:
    hosts = hosts_for(config)
    nodes, unreachable = Nodes.connect_reachable(hosts, config.ssh.accept_new_host_keys)
    try:
        if command == "kill":
            kill(nodes, config, console, unreachable)
            return 0
        if command == "status":
            ok = (print_all_jobs(nodes, console, unreachable) if config.all_jobs
                  else print_status(nodes, config.job, console, unreachable))
            if not ok:
                raise MultiHostError("status", unreachable)
            return 0
        if command == "plot":
            return plot(nodes, config, console)
        if not nodes.reachable():  # "no container found" would hide that no host answered at all
            raise MultiHostError("logs", unreachable)
        if config.rank is not None:
            rank_logs(nodes, config.job, console, config.rank, config.tail, config.follow)
        else:
            stream_logs(nodes, config.job, console, config.follow, config.node, config.tail)
        if unreachable:
            raise MultiHostError("logs", unreachable)
        return 0
    finally:
        nodes.close()


def kill(nodes: Nodes, config: JobsConfig, console: Console, unreachable: dict[str, str]) -> None:
    """The stop record first, on every host (an `up` waiting to restart the job, from any machine, then starts
    nothing more: see jobs/stops.py), then the job's containers. A host where either fails is reported."""
    not_left = stops.leave(nodes, config.job)
    left = len(nodes.reachable()) - len(not_left)
    if left:
        console.print(f"left a stop record on {left} host(s): an 'up' of job {config.job!r} waiting to restart it "
                      "starts nothing more", markup=False, highlight=False)
    kill_job(nodes, config.job, config.grace, console, {**unreachable, **not_left})


def plot(nodes: Nodes, config: JobsConfig, console: Console) -> int:
    """metrics.jsonl from node 0, drawn locally (trainer.plot: matplotlib, no torch)."""
    import posixpath

    from trainer.contract import METRICS_FILE
    from trainer.plot import PlotError, plot_text

    remembered = state.load(config.job)
    host, folder = node0_ckpt_dir(nodes, config.job, remembered.options.get("ckpt_dir") if remembered else None)
    path = posixpath.join(folder, METRICS_FILE)
    try:
        text = nodes.conn(host).read_file(path).decode(errors="replace")
    except OSError:
        raise JobError(f"no {METRICS_FILE} of job {config.job!r} at {nodes.hosts[host].label}:{path} (the trainer "
                       "writes one record per epoch; another program may write none)") from None
    out = config.out or Path(f"{config.job}-metrics.png")
    try:
        plot_text(text, out, f"job {config.job}", f"{nodes.hosts[host].label}:{path}")
    except PlotError as err:
        raise JobError(str(err)) from None
    console.print(f"wrote {out} (from {nodes.hosts[host].label}:{path})", markup=False, highlight=False)
    return 0
