"""`up`: hosts → preflight → plan → image → data → start → watch. Nothing starts unless preflight passes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from . import state
from .config import UpConfig
from .entry import check_image
from .errors import JobError
from .hosts import Host, parse_hosts_file
from .image import ensure_images
from .launch import End, find_resume_checkpoint, remove_leftovers, start_containers, summary, watch
from .nodes import Nodes
from .plan import NodeFacts, NodeSpec, build_plan, render_plan
from .prefetch import make_dirs, prefetch_all
from .preflight import run_preflight
from .ssh import fan_out


def load_hosts(config: UpConfig) -> list[Host]:
    assert config.ssh.hosts_file is not None
    return parse_hosts_file(config.ssh.hosts_file, config.ssh.ssh_config)


def local_image(name: str) -> tuple[Any, str | None]:
    """The local daemon's client and image ID (None, None when there is no local daemon)."""
    import docker
    import docker.errors

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception:
        return None, None
    try:
        return client, str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return client, None


class Timings:
    """Wall time of each phase of `up`, in order (`up --timings`)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.phases: list[tuple[str, float]] = []
        self.channels: dict[str, int] = {}  # host -> the most SSH channels held there at once

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((name, time.monotonic() - t0))


    def render(self) -> str:
        parts = [f"{name} {took:.2f}" for name, took in self.phases]
        line = f"timings (s): {', '.join(parts)}; total {time.monotonic() - self.start:.2f}"
        if self.channels:  # OpenSSH allows 10 per connection by default (MaxSessions)
            line += "\npeak SSH channels per host: " + ", ".join(f"{h} {n}" for h, n in self.channels.items())
        return line


def up(config: UpConfig, console: Console) -> int:
    timings = Timings()
    try:
        return _up(config, console, timings)
    finally:
        if config.timings and not config.dry_run:
            console.print(timings.render(), markup=False, highlight=False)


def _up(config: UpConfig, console: Console, timings: Timings) -> int:
    hosts = load_hosts(config)
    if config.dry_run:
        # Offline: nothing is contacted; interfaces and GPU counts are shown as detected at launch.
        specs = build_plan(config, hosts, config.master_addr or hosts[0].hostname)
        console.print(render_plan(specs), markup=False, highlight=False, soft_wrap=True)
        return 0
    with timings.phase("connect"), ThreadPoolExecutor(1) as pool:
        local_lookup = pool.submit(local_image, config.image)  # the local daemon, while SSH handshakes run
        nodes = Nodes.connect(hosts, config.ssh.accept_new_host_keys)
        local, local_id = local_lookup.result()
    try:
        master = config.master_addr or nodes.conn(0).peer_address
        with timings.phase("preflight"):
            reports = run_preflight(nodes.conns, config, master, local_id, console)  # type: ignore[arg-type]
        for rank, report in enumerate(reports):
            nodes.adopt_docker(rank, report.docker)
        facts = [NodeFacts(iface=r.iface, gpus=r.gpus, home=r.identity.home, user=r.identity.user_spec,
                           login=r.identity.name) if r.identity else NodeFacts(iface=r.iface, gpus=r.gpus)
                 for r in reports]
        specs = build_plan(config, hosts, master, facts)
        if config.resume:
            with timings.phase("resume"):
                _resume(nodes, specs, config, console)
        with timings.phase("image"):
            ensure_images(nodes, config, local, local_id, console, [r.image_id for r in reports])
            # The image is on every node now: one short container on node 0 checks torch and the entry.
            launcher = check_image(nodes.conn(0), config)
        specs = build_plan(config, hosts, master, facts, launcher)
        with timings.phase("data"):
            _data(nodes, config, console)
        with timings.phase("start"):
            remove_leftovers(nodes, config, config.grace, [i for i, r in enumerate(reports) if r.containers])
            remember(config)
            containers = start_containers(nodes, specs)
        console.print(f"job {config.job!r} started: {len(specs)} node(s), master {master}:{config.master_port}",
                      markup=False, highlight=False)
        if config.detach:
            console.print(f"detached; follow with 'logs -f --job {config.job}', stop with 'kill --job {config.job}'",
                          markup=False)
            return 0
        with timings.phase("run"):
            outcome = watch(nodes, specs, containers, config, console)
        if not outcome.ok:
            where = f"node {outcome.failed_rank} ({specs[outcome.failed_rank].host.label}) " \
                if outcome.failed_rank is not None else ""
            cleaned = (f"stopped where reachable; run 'kill --job {config.job}' once all hosts answer"
                       if outcome.leftovers else "the job was stopped on all nodes")
            raise JobError(f"job {config.job!r} failed: {where}{outcome.reason}; {cleaned}")
        if outcome.end is not End.DETACHED:
            with timings.phase("summary"):
                summary(nodes, specs, console)
        return 0
    finally:
        timings.channels = {c.host.label: c.peak_channels for c in nodes.conns if c is not None}
        nodes.close()


def _resume(nodes: Nodes, specs: list[NodeSpec], config: UpConfig, console: Console) -> None:
    try:
        find_resume_checkpoint(nodes, specs, console)
    except JobError:
        if config.is_trainer:
            raise
        # Another program that writes no manifest (docs/DESIGN.md §7) finds its own state: RESUME=1 only.
        console.print("--resume: no valid checkpoint (manifest and matching .pt); the program gets RESUME=1 and "
                      "finds its own state (resume by flag only)", markup=False, highlight=False)


def _data(nodes: Nodes, config: UpConfig, console: Console) -> None:
    """CIFAR-10 is the trainer's data; another program brings its own (in the data dir): only make the dirs."""
    if not config.is_trainer:
        fan_out("dirs", nodes.conns, lambda c: make_dirs(c, config), lambda c: c.host.label)  # type: ignore[arg-type]
        return
    for res in prefetch_all(nodes.conns, lambda r: nodes.docker(r, timeout=3600), config,  # type: ignore[arg-type]
                            console):
        what = {"present": "verified copy present, nothing moved", "downloaded": f"downloaded {res.bytes_moved} bytes",
                "sent": f"sent {res.bytes_moved} bytes",
                "shared": f"same folder as on {res.shared_with} (shared storage), nothing moved"}[res.action]
        console.print(f"data on {res.label}: {what}", markup=False, highlight=False)


def remember(config: UpConfig) -> Path:
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()
               if k not in ("ssh", "env")}
    options["env_names"] = [k for k, _ in config.env]  # values are not stored: they may be secrets
    return state.save(state.JobState(config.job, str(Path(config.ssh.hosts_file or "").resolve()),
                                     str(config.ssh.ssh_config) if config.ssh.ssh_config else None, options))
