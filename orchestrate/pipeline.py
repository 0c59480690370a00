"""The `up` pipeline: hosts → probe (preflight and the facts) → the attempt's JobPlan → image → data → start →
watch, and again from the newest checkpoint after a failure (--max-restarts); `check` shares its first phases.
Nothing starts unless preflight passes. The plan is built once per attempt; every phase after it reads it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from orchestrate import jobfile
from orchestrate.apply.claim import start_claimed
from orchestrate.apply.data import make_dirs, prefetch_all
from orchestrate.apply.image import ensure_images
from orchestrate.apply.layercache import REGISTRY_BINARY, registry_binary
from orchestrate.apply.staging import stage_all
from orchestrate.apply.start import copy_resume_checkpoint, remove_leftovers
from orchestrate.checks import selfcheck
from orchestrate.checks.netcheck import measure, require_all_joined
from orchestrate.config import UpConfig, url_masked
from orchestrate.errors import ConfigError, JobError, NoCheckpointError
from orchestrate.hosts import Host, match_exec_blocks, parse_hosts_file, ssh_config_path
from orchestrate.jobs import memory as state
from orchestrate.jobs import stops
from orchestrate.plan.jobplan import (
    Attempt,
    JobPlan,
    NodeFacts,
    ResumePoint,
    build_plan,
    offline_json,
    plan_job,
    plan_json,
    render_job_plan,
    render_plan,
)
from orchestrate.probe import gpuprobe
from orchestrate.probe.facts import local_data, local_image, local_layers, node_facts
from orchestrate.probe.hostboot import await_hosts
from orchestrate.probe.imagecheck import check_image
from orchestrate.probe.platforms import local_platform, require_same
from orchestrate.probe.preflight import HostReport, run_preflight
from orchestrate.probe.resume import find_resume_checkpoint, newest_step
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out
from orchestrate.watch.hangup import Hangup
from orchestrate.watch.outcome import End, Outcome
from orchestrate.watch.report import summary
from orchestrate.watch.watcher import watch
from trainer.contract import ENV_RESUME

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient
    from docker.models.containers import Container


def load_hosts(config: UpConfig) -> list[Host]:
    assert config.ssh.hosts_file is not None
    # The offline dry run runs nothing; --dry-run=hosts connects as `up` would, so the ssh config applies whole.
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
        if config.timings and not (config.dry_run or config.dry_run_hosts):
            console.print(timings.render(), markup=False, highlight=False)


def _up(config: UpConfig, console: Console, timings: Timings, hangup: Hangup) -> int:
    hosts = load_hosts(config)
    if config.min_nodes is not None and config.min_nodes > len(hosts):
        raise ConfigError(f"--min-nodes {config.min_nodes} exceeds the {len(hosts)} host(s) in "
                          f"{config.ssh.hosts_file}; give at most {len(hosts)}")
    if config.layer_cache == "on" and not config.pull and registry_binary() is None:
        raise ConfigError(f"--layer-cache on: {REGISTRY_BINARY} is not installed here; install it (Debian: apt-get "
                          "install docker-registry) or use --layer-cache auto")
    if config.dry_run:
        _print_offline(config, hosts, console)
        return 0
    if config.dry_run_hosts:
        _print_probed(config, hosts, console)
        return 0
    attempt, previous = Attempt.first(config), None
    while True:
        result = _attempt(config, attempt, hosts, console, timings, hangup)
        if result.outcome.ok:
            return 0
        _restart_or_raise(config, attempt.number, result, previous, hosts, console)
        if result.outcome.end in (End.HOST, End.UNREACHABLE) and not config.min_nodes:
            # Without --min-nodes every host is needed: a rebooting host or a restarting daemon is waited for.
            await_hosts(hosts, config.ssh.accept_new_host_keys, console)
        previous = result
        attempt = Attempt(attempt.number + 1, result.outcome.cause, resume=True)


def _print_offline(config: UpConfig, hosts: list[Host], console: Console) -> None:
    """Offline: nothing is contacted; interfaces and GPU counts are shown as detected at launch."""
    specs = build_plan(config, hosts, config.master_addr or hosts[0].hostname)
    if config.as_json:
        _print_json(console, offline_json(specs))
        return
    console.print("# the job (a job file for 'up -f'; options that differ from the defaults, secrets masked)",
                  markup=False)
    console.print("\n".join(f"#   {line}" for line in jobfile.of_config(config).splitlines()), markup=False,
                  highlight=False, soft_wrap=True)
    console.print(render_plan(specs), markup=False, highlight=False, soft_wrap=True)
    note = _match_exec_note(config)
    if note:
        console.print(note, markup=False, highlight=False, soft_wrap=True)


def _print_probed(config: UpConfig, hosts: list[Host], console: Console) -> None:
    """`--dry-run=hosts`: connect, probe read-only, print the first attempt's plan; nothing is created, sent or
    started anywhere. With --json the plan alone goes to stdout, the preflight table to stderr."""
    chatter = Console(stderr=True) if config.as_json else console
    attempt = Attempt.first(config)
    ready = _ready(config, attempt, hosts, chatter, Timings())
    try:
        plan, _ = _plan(config, attempt, ready, chatter, Timings(), on_hosts=False)
    finally:
        ready.nodes.close()
    if config.as_json:
        _print_json(console, plan_json(plan))
    else:
        console.print(render_job_plan(plan), markup=False, highlight=False, soft_wrap=True)


def _print_json(console: Console, data: dict[str, Any]) -> None:
    # soft_wrap: rich would otherwise break long strings at the console's width, and the JSON with them.
    console.print(json.dumps(data, indent=2), markup=False, highlight=False, soft_wrap=True)


BACKOFF_S = 10.0  # before the first automatic restart; doubled each time, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 60.0
KILLED_IN_BACKOFF = "job {job!r} was stopped with 'kill' during the restart backoff; nothing runs, no restart follows"


@dataclass
class AttemptResult:
    """How one start of the job ended (an automatic restart is another attempt)."""

    outcome: Outcome
    resumed_from: int | None = None  # the checkpoint step it started from (None: from scratch)
    newest_step: int | None = None  # the newest valid checkpoint when it ended (None: none)

    @property
    def progressed(self) -> bool:
        return self.newest_step is not None and self.newest_step != self.resumed_from


def _restart_or_raise(config: UpConfig, number: int, attempt: AttemptResult, previous: AttemptResult | None,
                      hosts: list[Host], console: Console) -> None:
    """Raise the job's failure unless an automatic restart is due after attempt `number` (0: the first start);
    then wait out the backoff (a `kill` from any machine, seen as its stop record on the hosts, or Ctrl-C
    meanwhile ends it all)."""
    outcome = attempt.outcome
    failure = _failure_text(config, outcome)
    if not outcome.end.restartable or number >= config.max_restarts:
        used = f" (after {number} automatic restart(s))" if number else ""
        raise JobError(failure + used)
    # The same kind of failure, and not one new checkpoint since the last: restarting again would repeat it. The
    # node named may differ (when one rank crashes its peers exit too, and which exit is seen first varies).
    if previous is not None and not attempt.progressed and previous.outcome.end is outcome.end:
        since = "" if attempt.resumed_from is None else f" (step {attempt.resumed_from})"
        raise JobError(f"{failure}; the same failure repeated before any new checkpoint was written{since}: not "
                       "restarting again, fix the cause then 'up --resume'")
    wait = min(BACKOFF_S * 2 ** number, MAX_BACKOFF_S)
    console.print(f"restart {number + 1} of {config.max_restarts} in {wait:.0f} s, from the newest valid "
                  f"checkpoint; cause: {outcome.cause}", markup=False, highlight=False)
    deadline = time.monotonic() + wait
    nodes, _ = Nodes.connect_reachable(hosts, config.ssh.accept_new_host_keys)  # a host still down is not waited for
    try:
        while time.monotonic() < deadline:
            looked = time.monotonic()
            if stops.seen(nodes, config.job):
                raise JobError(KILLED_IN_BACKOFF.format(job=config.job))
            time.sleep(max(0.0, min(stops.POLL_S - (time.monotonic() - looked), deadline - time.monotonic())))
    except KeyboardInterrupt:
        raise JobError(f"job {config.job!r}: Ctrl-C during the restart backoff; nothing runs, no restart "
                       "follows") from None
    finally:
        nodes.close()


def _failure_text(config: UpConfig, outcome: Outcome) -> str:
    cleaned = (f"stopped where reachable; run 'kill --job {config.job}' once all hosts answer"
               if outcome.leftovers else "the job was stopped on all nodes")
    return f"job {config.job!r} failed: {outcome.cause}; {cleaned}"



@dataclass
class Ready:
    """The hosts connected and past preflight: what every command that starts containers needs first."""

    nodes: Nodes
    reports: list[HostReport]
    master: str
    local: DockerClient | None  # the local Docker client (None: no local daemon)
    local_id: str | None  # the image's ID here
    port: int | None  # node 0's master port, given or chosen by preflight (plan/ports.py)


def _ready(config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console, timings: Timings) -> Ready:
    """Connect and preflight (the table; nothing starts unless it passes)."""
    with timings.phase("connect"), ThreadPoolExecutor(1) as pool:
        local_lookup = pool.submit(local_image, config.image)  # the local daemon, while SSH handshakes run
        nodes = _connect(config, attempt, hosts, console)
        local, local_id = local_lookup.result()
    try:
        with timings.phase("preflight"):
            nodes, reports, master = _preflight(nodes, config, attempt, local_id, console)
            if not config.pull:  # what is sent must run there (a pull picks the node's platform itself)
                require_same(config.image, local_platform(local, config.image), [(r.label, r.docker) for r in reports])
    except BaseException:
        nodes.close()
        raise
    for rank, report in enumerate(reports):
        nodes.adopt_docker(rank, report.docker)
    return Ready(nodes, reports, master, local, local_id, reports[0].port)


def _plan(config: UpConfig, attempt: Attempt, ready: Ready, console: Console, timings: Timings,
          on_hosts: bool = True) -> tuple[JobPlan, list[NodeFacts]]:
    """The attempt's plan, from what the read-only probe finds: the nodes' layers and data, the resume checkpoint,
    the launcher (`on_hosts` False: no check container on a host, as for a dry run); and the facts it was built
    from (a lost GPU/port claim plans again from them: apply/claim.py)."""
    with timings.phase("plan"):
        image = local_layers(ready.local, ready.local_id)
        facts = node_facts(ready.nodes, ready.reports, config, image)
        resume, attempt = _resume(ready, config, attempt, console) if attempt.resume else (None, attempt)
        archive_bytes, from_folder = local_data(config)
        return plan_job(config, attempt, ready.nodes.hosts, ready.master, facts, image,
                        _launcher(config, ready, on_hosts), resume, archive_bytes, from_folder, ready.port), facts


def _launcher(config: UpConfig, ready: Ready, on_hosts: bool) -> tuple[str, ...] | None:
    """How torchrun starts in the image the nodes will run, checked before anything is sent: on this machine's
    daemon when the nodes run its image (same ID), else on node 0 where it keeps its own; None when node 0 has
    still to pull it (then it is checked after the pull)."""
    node0, here = ready.reports[0].image_id, ready.local_id
    memo_id = None if config.pull else here  # a pulled image may differ from a local one of the same name
    if here is not None and (not config.pull or node0 == here):
        return check_image(ready.nodes.conn(0), config, memo_id, here=ready.local)
    if node0 is not None and on_hosts:
        return check_image(ready.nodes.conn(0), config, memo_id)
    return None


def _resume(ready: Ready, config: UpConfig, attempt: Attempt,
            console: Console) -> tuple[ResumePoint | None, Attempt]:
    """The checkpoint this attempt resumes from, and the attempt as it runs (a restart before the first
    checkpoint starts over)."""
    try:
        return find_resume_checkpoint(ready.nodes, [r.dirs["ckpt"] for r in ready.reports], console), attempt
    except NoCheckpointError:
        if config.is_trainer and attempt.number:
            # The failure came before the first checkpoint: nothing is lost by starting over.
            console.print(f"restart {attempt.number}: no checkpoint was written before the failure; training "
                          "starts again from the beginning", markup=False, highlight=False)
            return None, dataclasses.replace(attempt, resume=False)
        if config.is_trainer:
            raise
        # Another program that writes no manifest (docs/DESIGN.md §7) finds its own state: RESUME=1 only.
        console.print(f"--resume: no valid checkpoint (manifest and matching .pt); the program gets {ENV_RESUME}=1 and "
                      "finds its own state (resume by flag only)", markup=False, highlight=False)
        return None, attempt


def _images(ready: Ready, plan: JobPlan, config: UpConfig, console: Console) -> JobPlan:
    """The image onto every node as planned; then, where node 0 had to pull it first, the launcher read from it."""
    ensure_images(ready.nodes, plan, ready.local, ready.local_id, console, config.layer_cache)
    if plan.launcher is not None:
        return plan
    return plan.with_launcher(check_image(ready.nodes.conn(0), config, None if config.pull else ready.local_id))


def check(config: UpConfig, console: Console) -> int:
    """`check`: the first-day self-test (preflight, the image where missing, then per node the GPU probe, a
    training step and a checkpoint, and the network check); exit 1 when a part failed or a node is an outlier."""
    attempt, timings = Attempt.first(config), Timings()
    ready = _ready(config, attempt, load_hosts(config), console, timings)
    try:
        plan = _images(ready, _plan(config, attempt, ready, console, timings)[0], config, console)
        return selfcheck.run(ready.nodes, plan.specs, config, None if config.pull else ready.local_id, console)
    finally:
        ready.nodes.close()


def _attempt(config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console, timings: Timings,
             hangup: Hangup) -> AttemptResult:
    if attempt.number:
        console.print(f"--- restart {attempt.number} of {config.max_restarts} ---", markup=False)
    ready = _ready(config, attempt, hosts, console, timings)
    nodes = ready.nodes
    try:
        if not attempt.number:  # only a kill typed while this `up` runs stops it (jobs/stops.py)
            stops.clear(nodes, config.job)
        plan, facts = _plan(config, attempt, ready, console, timings)
        with timings.phase("image"):
            plan = _images(ready, plan, config, console)
        if not config.cpu_mode:
            with timings.phase("GPU probe"):
                gpuprobe.require(gpuprobe.probe_all(nodes, plan.specs, None if config.pull else ready.local_id))
        if config.check_network and not attempt.number:
            with timings.phase("network check"):
                require_all_joined(measure(nodes, plan.specs, config.check_max_mb, console),
                                   [n.host.label for n in plan.nodes])
        with timings.phase("data"):
            _data(nodes, plan, config, console)
        with timings.phase("start"):
            plan, containers = _start(nodes, plan, facts, ready, config, console)
        console.print(f"job {config.job!r} started: {len(plan.nodes)} node(s), master {plan.master}",
                      markup=False, highlight=False)
        if config.detach:
            console.print(f"detached; follow with 'logs -f --job {config.job}', stop with 'kill --job {config.job}'",
                          markup=False)
            return AttemptResult(Outcome(True, End.DETACHED))
        return _watched(nodes, plan, containers, config, console, timings, hangup)
    finally:
        timings.channels = {c.host.label: c.peak_channels for c in nodes.conns if c is not None}
        nodes.close()


def _start(nodes: Nodes, plan: JobPlan, facts: list[NodeFacts], ready: Ready, config: UpConfig,
           console: Console) -> tuple[JobPlan, list[Container]]:
    """Leftovers out, then the containers created, their GPU sets and port claimed against other `up`s starting
    at the same moment (a lost claim plans them again: the plan returned is the one that started), started."""
    copy_resume_checkpoint(nodes, plan)
    remove_leftovers(nodes, config, config.grace, [n.rank for n in plan.nodes if n.leftovers])
    remember(config)  # the user's options: a port preflight chose is not kept
    launcher = plan.launcher or ("torchrun",)
    claim = start_claimed(nodes, config, plan.specs, facts, [r.present for r in ready.reports],
                          ready.reports[0].listening,
                          lambda port, f: build_plan(config, nodes.hosts, ready.master, f, launcher, plan.attempt,
                                                     port), console)
    plan = plan.with_claim(claim.specs, claim.port)
    _unless_stopped(nodes, config)
    return plan, claim.containers


def _unless_stopped(nodes: Nodes, config: UpConfig) -> None:
    """A kill that listed no container before they were created left its stop record first: seen here, the
    containers just started are removed and the job ends as the kill asked (the races: jobs/stops.py)."""
    if stops.seen(nodes, config.job):
        remove_leftovers(nodes, config, config.grace, nodes.reachable())
        raise JobError(f"job {config.job!r} was stopped with 'kill' as it started; its containers were removed, "
                       "nothing runs, no restart follows")


def _watched(nodes: Nodes, plan: JobPlan, containers: list[Container], config: UpConfig, console: Console,
             timings: Timings, hangup: Hangup) -> AttemptResult:
    specs = plan.specs
    resumed_from = plan.resume.checkpoint.step if plan.resume else None
    with timings.phase("run"):
        outcome = watch(nodes, specs, containers, config, console, hangup)
    if outcome.ok and outcome.end is not End.DETACHED:
        with timings.phase("summary"):
            summary(nodes, specs, console)
    if outcome.failed_rank is not None:  # the rank in this attempt's plan: say which host it was
        outcome.host = specs[outcome.failed_rank].host.label
    if outcome.ok or not outcome.end.restartable:
        return AttemptResult(outcome, resumed_from)
    return AttemptResult(outcome, resumed_from, newest_step(nodes, specs))


def _connect(config: UpConfig, attempt: Attempt, hosts: list[Host], console: Console) -> Nodes:
    """Every host, or (a restart with --min-nodes) every host that answers while enough do."""
    if not (attempt.number and config.min_nodes):
        return Nodes.connect(hosts, config.ssh.accept_new_host_keys)
    nodes, unreachable = Nodes.connect_reachable(hosts, config.ssh.accept_new_host_keys)
    for label, why in unreachable.items():
        console.print(f"leaving out {label}: {why}", markup=False, highlight=False)
    return _keep(nodes, nodes.reachable(), config, attempt, "reachable")


def _keep(nodes: Nodes, keep: list[int], config: UpConfig, attempt: Attempt, what: str) -> Nodes:
    assert config.min_nodes is not None
    if len(keep) < config.min_nodes:
        nodes.close()
        raise JobError(f"restart {attempt.number}: only {len(keep)} host(s) {what}, fewer than --min-nodes "
                       f"{config.min_nodes}; the job was stopped on all nodes; fix the hosts, then 'up --resume'")
    if len(keep) == len(nodes.hosts):
        return nodes
    for i, conn in enumerate(nodes.conns):
        if i not in keep and conn is not None:
            conn.close()
    return Nodes([nodes.hosts[i] for i in keep], [nodes.conns[i] for i in keep])


def _preflight(nodes: Nodes, config: UpConfig, attempt: Attempt, local_id: str | None,
               console: Console) -> tuple[Nodes, list[HostReport], str]:
    """Preflight (all must pass), or on a restart with --min-nodes: hosts that fail are left out while enough
    remain, then the rest is checked again (node 0 and the master may have changed). --replace is the first
    start's only: a restart finds no job of its own running."""
    may_fail, replace = bool(attempt.number and config.min_nodes), config.replace and not attempt.number
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.connected(), config, master, local_id, console, may_fail, replace)
    passed = [i for i, r in enumerate(reports) if not r.problems]
    if len(passed) == len(reports):
        return nodes, reports, master
    for r in reports:
        if r.problems:
            console.print(f"leaving out {r.label}: " + "; ".join(r.problems), markup=False, highlight=False)
    nodes = _keep(nodes, passed, config, attempt, "passed preflight")
    master = config.master_addr or nodes.conn(0).peer_address
    reports = run_preflight(nodes.connected(), config, master, local_id, console, replace=replace)
    return nodes, reports, master


def _data(nodes: Nodes, plan: JobPlan, config: UpConfig, console: Console) -> None:
    """Every node's data as planned: CIFAR-10 (downloaded, or its archive sent, where no verified copy is), a
    folder or file of --data-from synced, or only the folders made for another program."""
    conns, dirs = nodes.connected(), [n.dirs for n in plan.nodes]
    kind = plan.nodes[0].data.kind  # one kind for all nodes but "present" (a verified copy already there)
    if kind == "sync":
        for line in stage_all(conns, dirs, config, console):
            console.print(line, markup=False, highlight=False)
        return
    if kind == "none":
        fan_out("dirs", list(range(len(conns))), lambda r: make_dirs(conns[r], dirs[r]), lambda r: conns[r].host.label)
        return
    present = [n.data.kind == "present" for n in plan.nodes]
    for res in prefetch_all(conns, dirs, present, lambda r: nodes.docker(r, timeout=3600), config, console):
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
