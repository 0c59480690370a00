"""`check`, the first-day self-test of a cluster: per node the GPU probe, then the job's processes under torchrun
(one per GPU; at least 2 on a CPU node) taking a few training steps of the trainer's own model in the job's image
with the job's strategy and precision, and a checkpoint in the job's format saved and restored
(trainer/selftest.py), then the network check (netcheck.py); one table at the end to paste into a bug report.

A node whose GPU probe failed runs nothing more (its containers could not use the GPUs either); the network
check needs every node, so it runs only when all passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrate.backends.protocol import NodesT, Scheduler
from orchestrate.checks import gpuprobe, netcheck
from orchestrate.checks.netcheck import (
    Options,
    Verdict,
    measure,
    path_text,
    rate,
    require_all_joined,
)
from orchestrate.config import Checks, Program, Resources
from orchestrate.errors import MultiHostError
from orchestrate.plan import shortlived
from orchestrate.plan.jobplan import ContainerSpec, JobPlan
from orchestrate.plan.shortlived import network_check
from trainer.contract import SELFTEST_MARK

SELFTEST_TIMEOUT_S = 600  # import torch, build the model, 3 small steps, one checkpoint: a minute on a slow CPU


@dataclass(frozen=True)
class Cell:
    ok: bool
    text: str


@dataclass
class NodeRow:
    label: str
    gpus: Cell
    step: Cell = Cell(False, "-")
    ckpt: Cell = Cell(False, "-")
    network: Cell = Cell(False, "-")

    @property
    def ok(self) -> bool:
        return self.gpus.ok and self.step.ok and self.ckpt.ok and self.network.ok


def parse(logs: str) -> dict[str, Any] | None:
    """PURE: the node's answer from its processes' lines: the first error (lowest rank), else global rank 0's;
    None when none printed one. Each answer is read where its mark starts, so two processes' lines that ran
    together in the stream still count."""
    answers, decoder = [], json.JSONDecoder()
    for found in re.finditer(re.escape(SELFTEST_MARK) + "{", logs):
        try:
            answer, _ = decoder.raw_decode(logs, found.end() - 1)
        except ValueError:
            continue
        answers.append(dict(answer))
    answers.sort(key=lambda a: (a.get("error") is None, a.get("rank") or 0))
    return answers[0] if answers else None


def step_cell(payload: dict[str, Any] | None, exit_code: int | None) -> Cell:
    """PURE: the training steps' cell."""
    if payload is None:
        return Cell(False, f"no self-test answer (exit code {exit_code}); is the trainer in the image?")
    if not payload.get("steps"):
        return Cell(False, f"rank {payload.get('rank')}: {payload.get('error')}")
    if exit_code:  # every line said it passed, but a process ended badly (killed, or it never printed)
        return Cell(False, f"a process ended with exit code {exit_code} without saying why; see the node's logs")
    scaler = ", scaler" if payload.get("scaler") else ""
    kind = str(payload["device"]).split(":")[0]
    return Cell(True, f"{payload['strategy']} {payload['precision']} on {payload['world_size']} x {kind}{scaler}: "
                      f"{payload['steps']} steps, loss {payload['loss']:.3f}, {payload['step_s'] * 1000:.0f} ms/step")


def ckpt_cell(payload: dict[str, Any] | None) -> Cell:
    """PURE: the checkpoint round trip's cell."""
    if payload is None or not payload.get("steps"):
        return Cell(False, "-")
    if not payload.get("ckpt_ok"):
        return Cell(False, str(payload.get("error") or "not saved"))
    what = "sharded folder saved, restored" if payload.get("strategy") == "fsdp" else "saved, loaded"
    return Cell(True, f"{what}, equal ({payload['ckpt_bytes'] / 1e6:.1f} MB)")


def network_cells(verdict: Verdict, n: int) -> list[Cell]:
    """PURE: per node, its part in the network check."""
    cells = []
    for rank in range(n):
        if rank in verdict.cannot_join:
            cells.append(Cell(False, f"cannot join: {verdict.cannot_join[rank][:80]}"))
            continue
        parts = [f"within {rate(verdict.within_gbps[rank])}"] if rank in verdict.within_gbps else []
        parts += [f"best pair {rate(verdict.node_best[rank])}"] if rank in verdict.node_best else []
        parts += [path_text(verdict.paths[rank])] if rank in verdict.paths else []
        parts += ["OUTLIER"] if rank in verdict.outliers else []
        parts += verdict.problems.get(rank, [])
        ok = rank not in verdict.outliers and rank not in verdict.problems
        cells.append(Cell(ok, ", ".join(parts) or "joined"))
    return cells


def run(scheduler: Scheduler[NodesT], nodes: NodesT, plan: JobPlan, program: Program, resources: Resources, checks: Checks,
        image_id: str | None, console: Console) -> int:
    """The self-test on every node, its containers planned with the job's (plan/shortlived.py); 0 when every part
    passed on every node, else 1 (the table says where)."""
    specs = plan.specs
    rows = [NodeRow(s.host.label, Cell(True, "CPU mode")) for s in specs]
    if not resources.cpu_mode:
        for row, probe in zip(rows, gpuprobe.probe_all(scheduler, nodes, specs, [n.gpu_probe for n in plan.nodes], image_id),
                              strict=True):
            row.gpus = Cell(probe.problem is None, probe.text)
    ready = [r for r, row in enumerate(rows) if row.gpus.ok]
    for r, (payload, code) in zip(ready, _selftests(scheduler, nodes, shortlived.selftest(specs, program, resources, plan.torchrun), ready), strict=True):
        rows[r].step, rows[r].ckpt = step_cell(payload, code), ckpt_cell(payload)
    verdict = None
    if all(row.gpus.ok for row in rows):
        options = Options.of(checks, resources)
        containers = network_check(specs, options.cpu, options.max_mb, netcheck.script())
        verdict = measure(scheduler, nodes, containers, options, console)
        for row, cell in zip(rows, network_cells(verdict, len(rows)), strict=True):
            row.network = cell
    console.print(render(rows))
    if verdict is not None:
        require_all_joined(verdict, [s.host.label for s in specs])
    return 0 if all(row.ok for row in rows) else 1


def _selftests(scheduler: Scheduler[NodesT], nodes: NodesT, specs: Sequence[ContainerSpec], ranks: list[int]) -> list[tuple[dict[str, Any] | None, int]]:
    """Each node's self-test run to its end by the scheduler; a node where it could not start fails the command (one
    line per host)."""
    ran = scheduler.run(nodes, {r: specs[r] for r in ranks}, SELFTEST_TIMEOUT_S, "self-test")
    refused = {specs[r].host.label: ran[r].error for r in ranks if ran[r].exit_code is None}
    if refused:
        raise MultiHostError("self-test", refused)
    return [(parse(ran[r].output), ran[r].exit_code or 0) for r in ranks]


def render(rows: Sequence[NodeRow]) -> Table:
    table = Table(title="self-test")
    for col in ("node", "host", "GPU probe", "train step", "checkpoint", "network"):
        table.add_column(col)
    for rank, row in enumerate(rows):
        cells = [f"[{'green' if c.ok else 'red'}]{escape(c.text)}[/]" if c.text != "-" else "-"
                 for c in (row.gpus, row.step, row.ckpt, row.network)]
        table.add_row(str(rank), row.label, *cells)
    return table
