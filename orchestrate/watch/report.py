"""What `up` prints when an attempt ends (a failed node's last lines, a stall's stack dumps, a success's summary),
and the newest checkpoint it left (what the restart decision reads)."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from rich.console import Console

from orchestrate.backends.protocol import Ranks
from orchestrate.config import Program
from orchestrate.fanout import fan_out
from orchestrate.loglines import print_lines
from orchestrate.outcome import End, Outcome
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.probe.heartbeat import Beat
from orchestrate.watch.health import RankStack, culprits, flight_recorder_lines, read_fr_dumps
from trainer.contract import METRICS_FILE, STOP_LINE


class Watched(Protocol):
    """What a report reads of the watch of an attempt (watcher.py's Watcher, which calls the reports)."""

    ranks: Ranks
    specs: Sequence[ContainerSpec]
    console: Console
    secrets: list[str]

    @property
    def beat(self) -> Beat | None: ...

    def collect_stacks(self) -> list[RankStack]: ...

    def last_lines(self, rank: int) -> str: ...


FR_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # set by plan/jobplan.py for GPU jobs: where torch's flight recorder dumps go


def report_failure(watcher: Watched, outcome: Outcome, program: Program) -> tuple[Outcome, str | None]:
    """Print why the attempt failed; return the outcome with its blame (a stall's culprit) and, for a stall, the
    report to save in node 0's log dir (the pipeline writes it)."""
    console, specs = watcher.console, watcher.specs
    if outcome.end is End.STALLED:
        console.print(f"[bold red]job stalled: {outcome.reason}[/]")
        return _report_stall(watcher, outcome)
    rank = outcome.failed_rank if outcome.failed_rank is not None else 0
    console.print(f"[bold red]node {rank} ({specs[rank].host.label}) failed: {outcome.reason}[/]")
    if outcome.end is End.EXITED:  # its logs are there to show
        lines = watcher.last_lines(rank)
        console.print(f"last lines of node {rank}:", markup=False)
        print_lines(console, rank, lines, watcher.secrets)
        if STOP_LINE in lines:
            console.print("the trainer got SIGTERM (kill / docker stop) and wrote a checkpoint: "
                          f"continue with 'up --resume --job {program.job}'", markup=False)
    return outcome, None


def _report_stall(watcher: Watched, outcome: Outcome) -> tuple[Outcome, str]:
    """Stack dumps of every rank and the node whose ranks are not where the others wait; the text to save in
    node 0's log dir (the ranks' own dump files start afresh with the next run)."""
    console, specs = watcher.console, watcher.specs
    stacks = watcher.collect_stacks()
    lines = []
    for s in stacks:
        what = ("waiting in a collective" if s.in_collective else
                "NO DUMP (stopped, or frozen outside Python)" if not s.text else "busy outside any collective")
        lines.append(f"rank {s.rank} on node {s.node} ({specs[s.node].host.label}): {what}")
    blamed = culprits(stacks)
    if blamed:
        names = ", ".join(f"node {n} ({specs[n].host.label})" for n in blamed)
        lines.append(f"stalled by {names}: its ranks are not in the collective the others wait in")
        outcome = replace(outcome, failed_rank=blamed[0], reason=f"{outcome.reason}; stalled by {names}")
    elif stacks:
        lines.append("no single node to blame: every rank is in the same place (see the dumps)")
    if FR_ENV in specs[0].env:  # a GPU job: torch's flight recorder may have dumped (NCCL only)
        lines += flight_recorder_lines(_fr_dumps(watcher, stacks))
    if watcher.beat is not None:
        lines.append(f"last heartbeat: {watcher.beat.progress_line()} (slowest step so far "
                     f"{watcher.beat.slowest_step_s:.2f} s)")
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False)
    return outcome, "\n".join([*lines, "", *(f"==== rank {s.rank} on node {s.node}\n{s.text or '(no dump)'}"
                                          for s in stacks)])


def _fr_dumps(watcher: Watched, stacks: Sequence[RankStack]) -> dict[int, bytes]:
    dumps: dict[int, bytes] = {}
    for node, spec in enumerate(watcher.specs):
        try:
            dumps.update(read_fr_dumps(partial(watcher.ranks.read_file, node), spec.dirs["log"],
                                       [s.rank for s in stacks if s.node == node]))
        except Exception:  # an unreachable node has no dumps to give; the others still do
            continue
    return dumps


def summary(ranks: Ranks, specs: Sequence[ContainerSpec], console: Console) -> None:
    """Epochs, final accuracy (node 0's metrics.jsonl) and where the checkpoints are, read through the scheduler."""
    folder = specs[0].dirs["ckpt"]
    metrics = _last_metrics(ranks, folder)
    newest = ranks.newest_checkpoint(0, folder)
    if metrics:
        console.print(f"finished: epochs={metrics.get('epoch')} step={metrics.get('step')} "
                      f"test_acc={metrics.get('test_acc')} world_size={metrics.get('world_size')}",
                      markup=False, highlight=False)
    else:
        console.print(f"finished (no {METRICS_FILE} found on node 0)", markup=False)
    where = f"{specs[0].host.label}:{newest.path}" if newest else f"{specs[0].host.label}:{folder} (none valid)"
    console.print(f"checkpoint: {where}", markup=False, highlight=False)


def _last_metrics(ranks: Ranks, folder: str) -> dict[str, Any] | None:
    """The last line of node 0's metrics file in `folder`; None when there is none or it does not parse."""
    try:
        text = ranks.read_file(0, posixpath.join(folder, METRICS_FILE), 60).decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return dict(json.loads(lines[-1])) if lines else None
    except (OSError, ValueError):
        return None


def newest_step(ranks: Ranks, specs: Sequence[ContainerSpec]) -> int | None:
    """The newest valid checkpoint's step on the nodes that still answer (None: none anywhere)."""
    def one(rank: int) -> int | None:
        try:
            found = ranks.newest_checkpoint(rank, specs[rank].dirs["ckpt"])
        except Exception:  # an unreachable node has nothing to offer
            return None
        return found.step if found else None

    steps = [s for s in fan_out("checkpoint search", list(range(len(specs))), one, lambda r: specs[r].host.label)
             if s is not None]
    return max(steps, default=None)
