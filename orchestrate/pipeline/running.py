"""The attempt while it runs: the watcher observes (watch/), and this acts on what it returns: replicate each new
checkpoint meanwhile and the final one at the end, save a stall's report on node 0, stop the job on failure or on
Ctrl-C."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from rich.console import Console

from orchestrate.backends.protocol import NodesT, Ranks, Scheduler
from orchestrate.config import UpConfig
from orchestrate.masking import secret_values
from orchestrate.outcome import End, Outcome
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.watch.hangup import Hangup, TerminalGone
from orchestrate.watch.progress import ProgressView
from orchestrate.watch.report import report_failure
from orchestrate.watch.watcher import (
    FAILED_GRACE_S,
    STREAM_DRAIN_S,
    Watcher,
    blame_a_host_change,
    watch_until_end,
)


def watch(scheduler: Scheduler[NodesT], nodes: NodesT, specs: Sequence[ContainerSpec], ranks: Ranks, config: UpConfig,
          console: Console, hangup: Hangup) -> Outcome:
    """Stay attached until the job succeeds or a node fails; on failure stop the job everywhere. Meanwhile:
    progress from the heartbeat, each new checkpoint replicated off node 0. The terminal going away (SIGHUP) ends
    the watch and leaves the job running."""
    watcher = Watcher(specs, ranks, console, secret_values(config.program.env_dict), config.resilience.stall_timeout)
    replicator = scheduler.replicate(nodes, specs, config.resilience.ckpt_mirror, console)
    view = ProgressView(console)
    watcher.read_boots()
    watcher.start_streams()
    replicator.start()
    try:
        with hangup.watching():
            outcome = watch_until_end(watcher, view)
    except KeyboardInterrupt:
        watcher.stop_event.set()
        view.close()
        replicator.stop()
        return _interrupted(scheduler, nodes, config, console)
    except TerminalGone:
        watcher.stop_event.set()
        replicator.stop()
        return Outcome(True, End.DETACHED, None, "the terminal went away (SIGHUP)")
    finally:
        view.close()
    replicator.stop()
    watcher.drain_streams(STREAM_DRAIN_S)
    watcher.stop_event.set()
    if outcome.end is End.DONE:
        replicator.finish()
    if outcome.end in (End.EXITED, End.REMOVED) and scheduler.stop_record_seen(nodes, config.program.job):
        # Its nodes exited (SIGTERM) or vanished because a `kill` typed meanwhile stops the job: what the user
        # asked for, not a node's failure to report (jobs/stops.py). The kill stops the rest with its own grace: a
        # stop from here would cut their checkpoint short.
        return Outcome(False, End.KILLED, None, "stopped with 'kill'")
    if not outcome.ok:
        outcome, stall_report = report_failure(watcher, outcome, config.program)
        if stall_report is not None:
            _save_stall_report(ranks, specs, stall_report, console)
        console.print(f"stopping job {config.program.job!r} on all nodes", markup=False)
        try:
            # Short grace: with a peer gone the others cannot agree on a checkpoint anyway.
            scheduler.cancel(nodes, config.program.job, min(config.resilience.grace, FAILED_GRACE_S), console)
        except Exception as err:  # reported; the job failure is what matters
            console.print(f"while stopping: {err}", markup=False, highlight=False)
            outcome = replace(outcome, leftovers=True)
        if outcome.end is End.EXITED:
            outcome = blame_a_host_change(watcher, outcome)
    return outcome


def _save_stall_report(ranks: Ranks, specs: Sequence[ContainerSpec], report: str, console: Console) -> None:
    """The stall's stack dumps in node 0's log dir, written through the scheduler."""
    path = f"{specs[0].dirs['log']}/stall-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.txt"
    try:
        ranks.write_file(0, path, report.encode(), 60)
        console.print(f"stack dumps saved in {specs[0].host.label}:{path}", markup=False, highlight=False)
    except Exception as err:  # node 0 unreachable: the dumps were printed above
        console.print(f"could not save the stack dumps on node 0: {err}", markup=False, highlight=False)


def _interrupted(scheduler: Scheduler[NodesT], nodes: NodesT, config: UpConfig, console: Console) -> Outcome:
    stop = config.resilience.stop_on_interrupt
    if not stop:
        try:
            answer = console.input(f"\nStop job {config.program.job!r} on all nodes? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = "y"
        stop = answer.strip().lower() in ("y", "yes")
    if stop:
        scheduler.cancel(nodes, config.program.job, config.resilience.grace, console)
        return Outcome(False, End.INTERRUPTED, None, "stopped by Ctrl-C")
    console.print(f"job {config.program.job!r} keeps running; see it with 'status --job {config.program.job}', "
                  f"stop it with 'kill --job {config.program.job}'", markup=False)
    return Outcome(True, End.DETACHED, None, "detached")
