"""The `up` pipeline: hosts → preflight → plan → image → data → start → watch, and again from the newest
checkpoint after a failure (--max-restarts); `check` shares its first phases. Nothing starts unless preflight
passes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrate import jobfile
from orchestrate.apply.data import make_dirs, prefetch_all
from orchestrate.apply.image import ensure_images
from orchestrate.apply.layercache import REGISTRY_BINARY, registry_binary
from orchestrate.apply.staging import stage_all
from orchestrate.apply.start import remove_leftovers, start_containers
from orchestrate.checks import selfcheck
from orchestrate.checks.netcheck import measure, require_all_joined
from orchestrate.config import UpConfig, url_masked
from orchestrate.errors import ConfigError, JobError, NoCheckpointError
from orchestrate.hosts import Host, match_exec_blocks, parse_hosts_file, ssh_config_path
from orchestrate.jobs import memory as state
from orchestrate.plan.jobplan import NodeFacts, NodeSpec, build_plan, render_plan
from orchestrate.probe import gpuprobe
from orchestrate.probe.hostboot import await_hosts
from orchestrate.probe.imagecheck import check_image
from orchestrate.probe.platforms import local_platform, require_same
from orchestrate.probe.preflight import run_preflight
from orchestrate.probe.resume import find_resume_checkpoint, newest_step
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out
from orchestrate.watch.hangup import Hangup
from orchestrate.watch.outcome import End, Outcome
from orchestrate.watch.report import summary
from orchestrate.watch.watcher import watch


def load_hosts(config: UpConfig) -> list[Host]:
    assert config.ssh.hosts_file is not None
    return parse_hosts_file(config.ssh.hosts_file, config.ssh.ssh_config, run_match_exec=not config.dry_run)


def _match_exec_note(config: UpConfig) -> str | None:
    """A dry run runs nothing, also not the ssh config's `Match exec` commands: say which blocks it skipped."""
    path = ssh_config_path(config.ssh.ssh_config)
    try:
        blocks = match_exec_blocks(path.read_text()) if path.is_file() else []
    except (OSError, UnicodeDecodeError):
        return None
    where = ", ".join(f"{path}:{first}" for first, _ in blocks)
    return (f"# ssh config: Match exec at {where} not run (a dry run runs nothing); the hosts it would configure "
            "may differ at launch") if blocks else None


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
    timings, hangup = Timings(), Hangup()
    try:
        with hangup.handled():
            return _up(config, console, timings, hangup)
    finally:
        if config.timings and not config.dry_run:
            console.print(timings.render(), markup=False, highlight=False)


BACKOFF_S = 10.0  # before the first automatic restart; doubled each time, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 60.0


@dataclass
class Attempt:
    """One start of the job and how it ended (an automatic restart is another Attempt)."""

    outcome: Outcome
    resumed_from: int | None = None  # the checkpoint step it started from (None: from scratch)
    newest_step: int | None = None  # the newest valid checkpoint when it ended (None: none)

    @property
    def progressed(self) -> bool:
        return self.newest_step is not None and self.newest_step != self.resumed_from


def _up(config: UpConfig, console: Console, timings: Timings, hangup: Hangup) -> int:
    hosts = load_hosts(config)
    if config.min_nodes is not None and config.min_nodes > len(hosts):
        raise ConfigError(f"--min-nodes {config.min_nodes} exceeds the {len(hosts)} host(s) in "
                          f"{config.ssh.hosts_file}; give at most {len(hosts)}")
    if config.layer_cache == "on" and not config.pull and registry_binary() is None:
        raise ConfigError(f"--layer-cache on: {REGISTRY_BINARY} is not installed here; install it (Debian: apt-get "
                          "install docker-registry) or use --layer-cache auto")
    if config.dry_run:
        # Offline: nothing is contacted; interfaces and GPU counts are shown as detected at launch.
        specs = build_plan(config, hosts, config.master_addr or hosts[0].hostname)
        console.print("# the job (a job file for 'up -f'; options that differ from the defaults, secrets masked)",
                      markup=False)
        console.print("\n".join(f"#   {line}" for line in jobfile.of_config(config).splitlines()), markup=False,
                      highlight=False, soft_wrap=True)
        console.print(render_plan(specs), markup=False, highlight=False, soft_wrap=True)
        note = _match_exec_note(config)
        if note:
            console.print(note, markup=False, highlight=False, soft_wrap=True)
        return 0
    began, current, previous = time.time(), config, None
    while True:
        attempt = _attempt(current, hosts, console, timings, hangup)
        if attempt.outcome.ok:
            return 0
        _restart_or_raise(config, current, attempt, previous, began, console)
        if attempt.outcome.end in (End.HOST, End.UNREACHABLE) and not config.min_nodes:
            # Without --min-nodes every host is needed: a rebooting host or a restarting daemon is waited for.
            await_hosts(hosts, config.ssh.accept_new_host_keys, console)
        previous = attempt
        current = dataclasses.replace(config, resume=True, replace=False, restart=current.restart + 1,
                                      restart_cause=attempt.outcome.cause)


def _restart_or_raise(config: UpConfig, current: UpConfig, attempt: Attempt, previous: Attempt | None,
                      began: float, console: Console) -> None:
    """Raise the job's failure unless an automatic restart is due; then wait out the backoff (a `kill` or
    Ctrl-C meanwhile ends it all)."""
    outcome = attempt.outcome
    failure = _failure_text(config, outcome)
    if not outcome.end.restartable or current.restart >= config.max_restarts:
        used = f" (after {current.restart} automatic restart(s))" if current.restart else ""
        raise JobError(failure + used)
    # The same kind of failure, and not one new checkpoint since the last: restarting again would repeat it. The
    # node named may differ (when one rank crashes its peers exit too, and which exit is seen first varies).
    if previous is not None and not attempt.progressed and previous.outcome.end is outcome.end:
        since = "" if attempt.resumed_from is None else f" (step {attempt.resumed_from})"
        raise JobError(f"{failure}; the same failure repeated before any new checkpoint was written{since}: not "
                       "restarting again, fix the cause then 'up --resume'")
    wait = min(BACKOFF_S * 2 ** current.restart, MAX_BACKOFF_S)
    console.print(f"restart {current.restart + 1} of {config.max_restarts} in {wait:.0f} s, from the newest valid "
                  f"checkpoint; cause: {outcome.cause}", markup=False, highlight=False)
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            if state.killed_since(config.job, began):
                raise JobError(f"job {config.job!r} was stopped with 'kill' during the restart backoff; "
                               "nothing runs, no restart follows")
            time.sleep(0.5)
    except KeyboardInterrupt:
        raise JobError(f"job {config.job!r}: Ctrl-C during the restart backoff; nothing runs, no restart "
                       "follows") from None


def _failure_text(config: UpConfig, outcome: Outcome) -> str:
    cleaned = (f"stopped where reachable; run 'kill --job {config.job}' once all hosts answer"
               if outcome.leftovers else "the job was stopped on all nodes")
    return f"job {config.job!r} failed: {outcome.cause}; {cleaned}"


@dataclass
class Ready:
    """The hosts connected and past preflight: what every command that starts containers needs first."""

    nodes: Nodes
    reports: list[Any]
    master: str
    facts: list[NodeFacts]
    local: Any  # the local Docker client (None: no local daemon)
    local_id: str | None  # the image's ID here

    def images(self, config: UpConfig, console: Console) -> None:
        ensure_images(self.nodes, config, self.local, self.local_id, console, [r.image_id for r in self.reports])


def _ready(config: UpConfig, hosts: list[Host], console: Console, timings: Timings) -> Ready:
    """Connect, preflight (the table; nothing starts unless it passes) and the facts the plan needs."""
    with timings.phase("connect"), ThreadPoolExecutor(1) as pool:
        local_lookup = pool.submit(local_image, config.image)  # the local daemon, while SSH handshakes run
        nodes = _connect(config, hosts, console)
        local, local_id = local_lookup.result()
    try:
        with timings.phase("preflight"):
            nodes, reports, master = _preflight(nodes, config, local_id, console)
            if not config.pull:  # what is sent must run there (a pull picks the node's platform itself)
                require_same(config.image, local_platform(local, config.image), [(r.label, r.docker) for r in reports])
    except BaseException:
        nodes.close()
        raise
    for rank, report in enumerate(reports):
        nodes.adopt_docker(rank, report.docker)
    facts = [NodeFacts(iface=r.iface, gpus=r.gpus, home=r.identity.home, user=r.identity.user_spec,
                       login=r.identity.name, addr=r.addr, ib=r.ib) if r.identity else
             NodeFacts(iface=r.iface, gpus=r.gpus, addr=r.addr, ib=r.ib) for r in reports]
    return Ready(nodes, reports, master, facts, local, local_id)


def check(config: UpConfig, console: Console) -> int:
    """`check`: the first-day self-test (preflight, the image where missing, then per node the GPU probe, a
    training step and a checkpoint, and the network check); exit 1 when a part failed or a node is an outlier."""
    ready = _ready(config, load_hosts(config), console, Timings())
    try:
        specs = build_plan(config, ready.nodes.hosts, ready.master, ready.facts)
        ready.images(config, console)
        return selfcheck.run(ready.nodes, specs, config, None if config.pull else ready.local_id, console)
    finally:
        ready.nodes.close()


def _attempt(config: UpConfig, hosts: list[Host], console: Console, timings: Timings, hangup: Hangup) -> Attempt:
    if config.restart:
        console.print(f"--- restart {config.restart} of {config.max_restarts} ---", markup=False)
    ready = _ready(config, hosts, console, timings)
    nodes, reports, master, facts = ready.nodes, ready.reports, ready.master, ready.facts
    try:
        specs = build_plan(config, nodes.hosts, master, facts)
        resumed_from = None
        if config.resume:
            with timings.phase("resume"):
                config, resumed_from = _resume(nodes, specs, config, console)
        with timings.phase("image"):
            ready.images(config, console)
        with timings.phase("image check"):
            # The image is on every node now: one short container on node 0 checks torch and the entry. Where
            # it was sent (not pulled), node 0 holds the local ID: a check of that ID that passed is remembered.
            launcher = check_image(nodes.conn(0), config, None if config.pull else ready.local_id)
        specs = build_plan(config, nodes.hosts, master, facts, launcher)
        if not config.cpu_mode:
            with timings.phase("GPU probe"):
                gpuprobe.require(gpuprobe.probe_all(nodes, specs, None if config.pull else ready.local_id))
        if config.check_network and not config.restart:
            with timings.phase("network check"):
                require_all_joined(measure(nodes, specs, config.check_max_mb, console),
                                   [s.host.label for s in specs])
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
            return Attempt(Outcome(True, End.DETACHED))
        with timings.phase("run"):
            outcome = watch(nodes, specs, containers, config, console, hangup)
        if outcome.ok and outcome.end is not End.DETACHED:
            with timings.phase("summary"):
                summary(nodes, specs, console)
        if outcome.failed_rank is not None:  # the rank in this attempt's plan: say which host it was
            outcome.host = specs[outcome.failed_rank].host.label
        if outcome.ok or not outcome.end.restartable:
            return Attempt(outcome, resumed_from)
        return Attempt(outcome, resumed_from, newest_step(nodes, specs))
    finally:
        timings.channels = {c.host.label: c.peak_channels for c in nodes.conns if c is not None}
        nodes.close()


def _connect(config: UpConfig, hosts: list[Host], console: Console) -> Nodes:
    """Every host, or (a restart with --min-nodes) every host that answers while enough do."""
    if not (config.restart and config.min_nodes):
        return Nodes.connect(hosts, config.ssh.accept_new_host_keys)
    nodes, unreachable = Nodes.connect_reachable(hosts, config.ssh.accept_new_host_keys)
    for label, why in unreachable.items():
        console.print(f"leaving out {label}: {why}", markup=False, highlight=False)
    return _keep(nodes, nodes.reachable(), config, "reachable")


def _keep(nodes: Nodes, keep: list[int], config: UpConfig, what: str) -> Nodes:
    assert config.min_nodes is not None
    if len(keep) < config.min_nodes:
        nodes.close()
        raise JobError(f"restart {config.restart}: only {len(keep)} host(s) {what}, fewer than --min-nodes "
                       f"{config.min_nodes}; the job was stopped on all nodes; fix the hosts, then 'up --resume'")
    if len(keep) == len(nodes.hosts):
        return nodes
    for i, conn in enumerate(nodes.conns):
        if i not in keep and conn is not None:
            conn.close()
    return Nodes([nodes.hosts[i] for i in keep], [nodes.conns[i] for i in keep])


def _preflight(nodes: Nodes, config: UpConfig, local_id: str | None,
               console: Console) -> tuple[Nodes, list[Any], str]:
    """Preflight (all must pass), or on a restart with --min-nodes: hosts that fail are left out while enough
    remain, then the rest is checked again (node 0 and the master may have changed)."""
    may_fail = bool(config.restart and config.min_nodes)
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.conns, config, master, local_id, console, may_fail)  # type: ignore[arg-type]
    passed = [i for i, r in enumerate(reports) if not r.problems]
    if len(passed) == len(reports):
        return nodes, reports, master
    for r in reports:
        if r.problems:
            console.print(f"leaving out {r.label}: " + "; ".join(r.problems), markup=False, highlight=False)
    nodes = _keep(nodes, passed, config, "passed preflight")
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.conns, config, master, local_id, console)  # type: ignore[arg-type]
    return nodes, reports, master


def _resume(nodes: Nodes, specs: list[NodeSpec], config: UpConfig, console: Console) -> tuple[UpConfig, int | None]:
    """The config this attempt runs with and the step it resumes from (None: no checkpoint with a manifest)."""
    try:
        return config, find_resume_checkpoint(nodes, specs, console).step
    except NoCheckpointError:
        if config.is_trainer and config.restart:
            # The failure came before the first checkpoint: nothing is lost by starting over.
            console.print(f"restart {config.restart}: no checkpoint was written before the failure; training "
                          "starts again from the beginning", markup=False, highlight=False)
            return dataclasses.replace(config, resume=False), None
        if config.is_trainer:
            raise
        # Another program that writes no manifest (docs/DESIGN.md §7) finds its own state: RESUME=1 only.
        console.print("--resume: no valid checkpoint (manifest and matching .pt); the program gets RESUME=1 and "
                      "finds its own state (resume by flag only)", markup=False, highlight=False)
        return config, None


def _data(nodes: Nodes, config: UpConfig, console: Console) -> None:
    """CIFAR-10 is the trainer's data (downloaded, or its archive sent); a folder of --data-from (or, for another
    program, a single file) is synced incrementally; else another program finds its data in the data dir."""
    if config.data_from is not None and (config.data_from.is_dir() or not config.is_trainer):
        for line in stage_all(nodes.conns, config, console):  # type: ignore[arg-type]
            console.print(line, markup=False, highlight=False)
        return
    if not config.is_trainer:
        conns = [nodes.conn(r) for r in range(len(nodes.hosts))]
        fan_out("dirs", conns, lambda c: make_dirs(c, config), lambda c: c.host.label)
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
    options["data_url"] = url_masked(config.data_url)  # nor a password in the URL
    return state.save(state.JobState(config.job, str(Path(config.ssh.hosts_file or "").resolve()),
                                     str(config.ssh.ssh_config) if config.ssh.ssh_config else None, options))
