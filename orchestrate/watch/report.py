"""What `up` prints when an attempt ends: a failed node's last lines, a stall's stack dumps, a success's summary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from orchestrate.config import UpConfig
from orchestrate.jobs.control import print_lines
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.probe.checkpoints import last_metrics, newest_valid
from orchestrate.remote.session import Nodes
from orchestrate.watch.health import RankStack, culprits, flight_recorder_lines, read_fr_dumps
from orchestrate.watch.outcome import End, Outcome
from trainer.contract import METRICS_FILE, STOP_LINE

if TYPE_CHECKING:  # the watcher calls these reports: a runtime import would be a cycle
    from orchestrate.watch.watcher import Watcher

FR_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # set by plan/jobplan.py for GPU jobs: where torch's flight recorder dumps go


def report_failure(watcher: Watcher, outcome: Outcome, config: UpConfig) -> None:
    console, specs = watcher.console, watcher.specs
    if outcome.end is End.STALLED:
        console.print(f"[bold red]job stalled: {outcome.reason}[/]")
        _report_stall(watcher, outcome)
        return
    rank = outcome.failed_rank if outcome.failed_rank is not None else 0
    console.print(f"[bold red]node {rank} ({specs[rank].host.label}) failed: {outcome.reason}[/]")
    if outcome.end is End.EXITED:  # its logs are there to show
        lines = watcher.last_lines(rank)
        console.print(f"last lines of node {rank}:", markup=False)
        print_lines(console, rank, lines, watcher.secrets)
        if STOP_LINE in lines:
            console.print("the trainer got SIGTERM (kill / docker stop) and wrote a checkpoint: "
                          f"continue with 'up --resume --job {config.job}'", markup=False)


def _report_stall(watcher: Watcher, outcome: Outcome) -> None:
    """Stack dumps of every rank, the node whose ranks are not where the others wait, and all of it saved in
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
        outcome.failed_rank = blamed[0]
        names = ", ".join(f"node {n} ({specs[n].host.label})" for n in blamed)
        lines.append(f"stalled by {names}: its ranks are not in the collective the others wait in")
        outcome.reason += f"; stalled by {names}"
    elif stacks:
        lines.append("no single node to blame: every rank is in the same place (see the dumps)")
    if FR_ENV in specs[0].env:  # a GPU job: torch's flight recorder may have dumped (NCCL only)
        lines += flight_recorder_lines(_fr_dumps(watcher, stacks))
    if watcher.beat is not None:
        lines.append(f"last heartbeat: {watcher.beat.progress_line()} (slowest step so far "
                     f"{watcher.beat.slowest_step_s:.2f} s)")
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False)
    report = "\n".join([*lines, "", *(f"==== rank {s.rank} on node {s.node}\n{s.text or '(no dump)'}" for s in stacks)])
    path = f"{specs[0].dirs['log']}/stall-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.txt"
    try:
        watcher.nodes.conn(0).write_file(path, iter((report.encode(),)), timeout=60)
        console.print(f"stack dumps saved in {specs[0].host.label}:{path}", markup=False, highlight=False)
    except Exception as err:  # node 0 unreachable: the dumps were printed above
        console.print(f"could not save the stack dumps on node 0: {err}", markup=False, highlight=False)


def _fr_dumps(watcher: Watcher, stacks: Sequence[RankStack]) -> dict[int, bytes]:
    dumps: dict[int, bytes] = {}
    for node, spec in enumerate(watcher.specs):
        try:
            dumps.update(read_fr_dumps(watcher.nodes.conn(node), spec.dirs["log"],
                                       [s.rank for s in stacks if s.node == node]))
        except Exception:  # an unreachable node has no dumps to give; the others still do
            continue
    return dumps


def summary(nodes: Nodes, specs: Sequence[NodeSpec], console: Console) -> None:
    """Epochs, final accuracy (metrics.jsonl over SFTP) and where the checkpoints are."""
    folder = specs[0].dirs["ckpt"]
    metrics = last_metrics(nodes.conn(0), folder)
    newest = newest_valid(nodes.conn(0), folder)
    if metrics:
        console.print(f"finished: epochs={metrics.get('epoch')} step={metrics.get('step')} "
                      f"test_acc={metrics.get('test_acc')} world_size={metrics.get('world_size')}",
                      markup=False, highlight=False)
    else:
        console.print(f"finished (no {METRICS_FILE} found on node 0)", markup=False)
    where = f"{specs[0].host.label}:{newest.path}" if newest else f"{specs[0].host.label}:{folder} (none valid)"
    console.print(f"checkpoint: {where}", markup=False, highlight=False)

