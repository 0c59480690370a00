"""The `up` pipeline: hosts → probe (preflight and the facts) → the attempt's JobPlan → image → data → start →
watch, and again from the newest checkpoint after a failure (--max-restarts); `check` shares its first phases.
Nothing starts unless preflight passes. The plan is built once per attempt; every phase after it reads it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console

from orchestrate import jobfile
from orchestrate.backends.protocol import NodesT, Ranks, Scheduler
from orchestrate.checks import gpuprobe, selfcheck
from orchestrate.checks.netcheck import Options, measure, require_all_joined
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError
from orchestrate.hosts import Host, match_exec_blocks, parse_hosts_file, ssh_config_path
from orchestrate.jobs import stops
from orchestrate.outcome import End, Outcome
from orchestrate.pipeline import phases
from orchestrate.pipeline.attempt import plan_attempt
from orchestrate.pipeline.ready import connect_and_preflight
from orchestrate.pipeline.running import watch
from orchestrate.plan import gpus, restarts
from orchestrate.plan.jobplan import UNKNOWN, Attempt, JobPlan, PlanInputs, container_specs, pipeline_layout
from orchestrate.plan.restarts import AttemptResult
from orchestrate.restart import back_off
from orchestrate.terminal import console_for
from orchestrate.timings import Timings
from orchestrate.watch.hangup import Hangup
from orchestrate.watch.report import newest_step, summary


def load_hosts(config: UpConfig) -> list[Host]:
    assert config.ssh.hosts_file is not None
    # The offline dry run runs nothing; --dry-run=hosts connects as `up` would, so the ssh config applies whole.
    hosts = parse_hosts_file(config.ssh.hosts_file, config.ssh.ssh_config, run_match_exec=not config.mode.dry_run)
    mismatch = next(filter(None, (gpus.grant_mismatch(config.resources, h) for h in hosts)), None)
    if mismatch:
        raise ConfigError(mismatch)
    return hosts


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


def up(config: UpConfig, console: Console, scheduler: Scheduler[NodesT]) -> int:
    """`scheduler`: what runs the containers, chosen by the composition root (api.py) and passed down."""
    timings, hangup = Timings(), Hangup()
    try:
        with hangup.handled():
            return _up(config, console, scheduler, timings, hangup)
    finally:
        if config.mode.timings and not (config.mode.dry_run or config.mode.dry_run_hosts):
            console.print(timings.render(), markup=False, highlight=False)


def _up(config: UpConfig, console: Console, scheduler: Scheduler[NodesT], timings: Timings, hangup: Hangup) -> int:
    hosts = load_hosts(config)
    if config.resilience.min_nodes is not None and config.resilience.min_nodes > len(hosts):
        raise ConfigError(f"--min-nodes {config.resilience.min_nodes} exceeds the {len(hosts)} host(s) in "
                          f"{config.ssh.hosts_file}; give at most {len(hosts)}")
    scheduler.check_delivery(config.delivery)
    if config.mode.dry_run:
        _print_offline(config, hosts, console, scheduler)
        return 0
    if config.mode.dry_run_hosts:
        _print_probed(config, hosts, console, scheduler)
        return 0
    attempt, history = Attempt.first(config.resilience), list[AttemptResult]()
    while True:
        result = _attempt(config, scheduler, attempt, hosts, console, timings, hangup, history)
        if result.outcome.ok:
            return 0
        decision = restarts.decide(config.program.job, history, result, None, config.resilience)
        back_off(decision, config.program.job, scheduler, config.ssh, hosts, console)
        if decision.next is restarts.Next.WAIT_FOR_HOSTS:
            scheduler.await_hosts(hosts, config.ssh, console, decision.wait_s)
        history.append(result)
        attempt = Attempt(attempt.number + 1, result.outcome.cause, resume=True)


def _print_offline(config: UpConfig, hosts: list[Host], console: Console, scheduler: Scheduler[NodesT]) -> None:
    """Offline: nothing is contacted; interfaces and GPU counts are shown as detected at launch."""
    specs = container_specs(PlanInputs(config.program, config.resources, config.where, config.data, config.delivery,
                                       Attempt.first(config.resilience), tuple(hosts),
                                       config.where.master_addr or hosts[0].hostname))
    nprocs = [int(s.env["NPROC_PER_NODE"]) if s.env["NPROC_PER_NODE"].isdigit() else UNKNOWN for s in specs]
    layout = pipeline_layout(config.program.pipeline_stages, nprocs)  # refused here, before anything is printed
    if config.mode.as_json:
        _print_json(console, scheduler.materialize_offline(specs))
        return
    console.print("# the job (a job file for 'up -f'; options that differ from the defaults, secrets masked)",
                  markup=False)
    console.print("\n".join(f"#   {line}" for line in jobfile.of_config(config).splitlines()), markup=False,
                  highlight=False, soft_wrap=True)
    console.print(scheduler.containers_text(specs), markup=False, highlight=False, soft_wrap=True)
    if layout:
        console.print(layout, markup=False, highlight=False, soft_wrap=True)
    note = _match_exec_note(config)
    if note:
        console.print(note, markup=False, highlight=False, soft_wrap=True)


def _print_probed(config: UpConfig, hosts: list[Host], console: Console, scheduler: Scheduler[NodesT]) -> None:
    """`--dry-run=hosts`: connect, probe read-only, print the first attempt's plan; nothing is created, sent or
    started anywhere. With --json the plan alone goes to stdout, the preflight table to stderr."""
    chatter = console_for(stderr=True) if config.mode.as_json else console
    attempt = Attempt.first(config.resilience)
    ready = connect_and_preflight(scheduler, config, attempt, hosts, chatter, Timings())
    try:
        plan, _ = plan_attempt(config, attempt, ready, chatter, Timings(), on_hosts=False)
    finally:
        scheduler.close(ready.nodes)
    if config.mode.as_json:
        _print_json(console, scheduler.materialize(plan))
    else:
        console.print(scheduler.text(plan), markup=False, highlight=False, soft_wrap=True)


def _print_json(console: Console, data: dict[str, Any]) -> None:
    # soft_wrap: rich would otherwise break long strings at the console's width, and the JSON with them.
    console.print(json.dumps(data, indent=2), markup=False, highlight=False, soft_wrap=True)


def check(config: UpConfig, console: Console, scheduler: Scheduler[NodesT]) -> int:
    """`check`: the first-day self-test (preflight, the image where missing, then per node the GPU probe, a
    training step and a checkpoint, and the network check); exit 1 when a part failed or a node is an outlier."""
    attempt, timings = Attempt.first(config.resilience), Timings()
    ready = connect_and_preflight(scheduler, config, attempt, load_hosts(config), console, timings)
    try:
        plan = phases.images(ready, plan_attempt(config, attempt, ready, console, timings)[0], config, console)
        return selfcheck.run(scheduler, ready.nodes, plan, config.program, config.resources, config.checks,
                             None if config.delivery.pull else ready.local_id, console)
    finally:
        scheduler.close(ready.nodes)


def _attempt(config: UpConfig, scheduler: Scheduler[NodesT], attempt: Attempt, hosts: list[Host], console: Console,
             timings: Timings, hangup: Hangup, history: Sequence[AttemptResult]) -> AttemptResult:
    """One start of the job; `history`: how the attempts before it ended (a restart's hosts are decided on it)."""
    if attempt.number:
        console.print(f"--- restart {attempt.number} of {config.resilience.max_restarts} ---", markup=False)
    ready = connect_and_preflight(scheduler, config, attempt, hosts, console, timings, history)
    nodes = ready.nodes
    try:
        if not attempt.number:  # only a kill typed while this `up` runs stops it (jobs/stops.py)
            scheduler.clear_stop_record(nodes, config.program.job)
        plan, inputs = plan_attempt(config, attempt, ready, console, timings)
        with timings.phase("image"):
            plan = phases.images(ready, plan, config, console)
        if not config.resources.cpu_mode:
            with timings.phase("GPU probe"):  # a restart probes afresh: it follows a failure (XID 79 keeps the boot)
                remembered = None if config.delivery.pull or attempt.number else ready.local_id
                gpuprobe.require(gpuprobe.probe_all(scheduler, nodes, plan.specs, [n.gpu_probe for n in plan.nodes], remembered))
        if config.checks.check_network and not attempt.number:
            with timings.phase("network check"):
                checks = [n.network_check for n in plan.nodes if n.network_check is not None]
                require_all_joined(measure(scheduler, nodes, checks, Options.of(config.checks, config.resources), console),
                                   [n.host.label for n in plan.nodes])
        with timings.phase("data"):
            phases.data(ready, plan, config, console)
        stops.before_restart_starts(attempt.number)
        with timings.phase("start"):
            submitted = phases.start(ready, plan, inputs, config, console)
            plan = submitted.plan
        console.print(f"job {config.program.job!r} started: {len(plan.nodes)} node(s), master {plan.master}",
                      markup=False, highlight=False)
        if config.mode.detach:
            console.print(f"detached; follow with 'logs -f --job {config.program.job}', stop with 'kill --job {config.program.job}'",
                          markup=False)
            return AttemptResult(Outcome(True, End.DETACHED))
        return _watched(scheduler, nodes, plan, submitted.ranks, config, console, timings, hangup)
    finally:
        timings.channels = scheduler.channels_held(nodes)
        scheduler.close(nodes)


def _watched(scheduler: Scheduler[NodesT], nodes: NodesT, plan: JobPlan, ranks: Ranks, config: UpConfig,
             console: Console, timings: Timings, hangup: Hangup) -> AttemptResult:
    specs = plan.specs
    resumed_from = plan.resume.checkpoint.step if plan.resume else None
    with timings.phase("run"):
        outcome = watch(scheduler, nodes, specs, ranks, config, console, hangup)
    if outcome.ok and outcome.end is not End.DETACHED:
        with timings.phase("summary"):
            summary(ranks, specs, console)
    if outcome.failed_rank is not None:  # the rank in this attempt's plan: say which host it was
        outcome = replace(outcome, host=specs[outcome.failed_rank].host.label)
    if outcome.ok or outcome.end not in restarts.RESTARTABLE:  # no restart follows: no checkpoint to look for
        return AttemptResult(outcome, resumed_from)
    return AttemptResult(outcome, resumed_from, newest_step(ranks, specs))
