"""`check`, the first-day self-test of a cluster: per node the GPU probe, then a few training steps of the
trainer's own model in the job's image with the chosen precision and a checkpoint saved and loaded
(trainer/selftest.py), then the network check (netcheck.py); one table at the end to paste into a bug report.

A node whose GPU probe failed runs nothing more (its containers could not use the GPUs either); the network
check needs every node, so it runs only when all passed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrate.checks.netcheck import Verdict, measure, require_all_joined
from orchestrate.config import UpConfig
from orchestrate.jobs.owner import OWNER_LABEL, container_name
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.probe import gpuprobe
from orchestrate.remote.docker import JOB_LABEL
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out
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


def selftest_specs(specs: Sequence[NodeSpec], config: UpConfig) -> list[NodeSpec]:
    """PURE: the job's containers turned into the self-test's: same image, environment, user and GPUs; no
    network, no mounts (it writes its checkpoint under the container's /tmp), its own name and job label."""
    job = f"{config.job}-selftest"
    device = "cpu" if config.cpu_mode else "cuda"  # a GPU job must fail here when CUDA is missing, not fall back
    command = ("python3", "-m", "trainer.selftest", *config.trainer_args, "--device", device)
    return [dataclasses.replace(s, name=container_name(job, s.rank, s.labels.get(OWNER_LABEL)), command=command, mounts=(), network_mode="none",
                                extra_hosts=(), labels={**s.labels, JOB_LABEL: job}) for s in specs]


def parse(logs: str) -> dict[str, Any] | None:
    """PURE: the self-test's line (the last one with its mark); None when it printed none."""
    for line in reversed(logs.splitlines()):
        if line.startswith(SELFTEST_MARK):
            try:
                return dict(json.loads(line[len(SELFTEST_MARK):]))
            except ValueError:
                return None
    return None


def step_cell(payload: dict[str, Any] | None, exit_code: int | None) -> Cell:
    """PURE: the training steps' cell."""
    if payload is None:
        return Cell(False, f"no self-test answer (exit code {exit_code}); is the trainer in the image?")
    if not payload.get("steps"):
        return Cell(False, str(payload.get("error")))
    scaler = ", scaler" if payload.get("scaler") else ""
    return Cell(True, f"{payload['precision']} on {payload['device']}{scaler}: {payload['steps']} steps, "
                      f"loss {payload['loss']:.3f}, {payload['step_s'] * 1000:.0f} ms/step")


def ckpt_cell(payload: dict[str, Any] | None) -> Cell:
    """PURE: the checkpoint round trip's cell."""
    if payload is None or not payload.get("steps"):
        return Cell(False, "-")
    if not payload.get("ckpt_ok"):
        return Cell(False, str(payload.get("error") or "not saved"))
    return Cell(True, f"saved, loaded, equal ({payload['ckpt_bytes'] / 1e6:.1f} MB)")


def network_cells(verdict: Verdict, n: int) -> list[Cell]:
    """PURE: per node, its part in the network check."""
    cells = []
    for rank in range(n):
        if rank in verdict.cannot_join:
            cells.append(Cell(False, f"cannot join: {verdict.cannot_join[rank][:80]}"))
        elif rank in verdict.node_best:
            outlier = " OUTLIER" if rank in verdict.outliers else ""
            cells.append(Cell(not outlier, f"best pair {verdict.node_best[rank] * 1000:.1f} MB/s{outlier}"))
        else:
            cells.append(Cell(True, "joined"))
    return cells


def run(nodes: Nodes, specs: Sequence[NodeSpec], config: UpConfig, image_id: str | None, console: Console) -> int:
    """The self-test on every node; 0 when every part passed on every node, else 1 (the table says where)."""
    rows = [NodeRow(s.host.label, Cell(True, "CPU mode")) for s in specs]
    if not config.cpu_mode:
        for row, probe in zip(rows, gpuprobe.probe_all(nodes, specs, image_id), strict=True):
            row.gpus = Cell(probe.problem is None, probe.text)
    ready = [r for r, row in enumerate(rows) if row.gpus.ok]
    for r, (payload, code) in zip(ready, _selftests(nodes, selftest_specs(specs, config), ready), strict=True):
        rows[r].step, rows[r].ckpt = step_cell(payload, code), ckpt_cell(payload)
    verdict = None
    if all(row.gpus.ok for row in rows):
        verdict = measure(nodes, specs, config.check_max_mb, console)
        for row, cell in zip(rows, network_cells(verdict, len(rows)), strict=True):
            row.network = cell
    console.print(render(rows))
    if verdict is not None:
        require_all_joined(verdict, [s.host.label for s in specs])
    return 0 if all(row.ok for row in rows) else 1


def _selftests(nodes: Nodes, specs: Sequence[NodeSpec], ranks: list[int]) -> list[tuple[dict[str, Any] | None, int]]:
    return fan_out("self-test", ranks, lambda r: _selftest(nodes.docker(r, timeout=SELFTEST_TIMEOUT_S), specs[r]),
                   lambda r: specs[r].host.label)


def _selftest(client: Any, spec: NodeSpec) -> tuple[dict[str, Any] | None, int]:
    """Run one node's self-test to its end; the container is removed whatever happened."""
    kwargs = spec.sdk_kwargs()
    kwargs.pop("detach")
    container = client.containers.create(**kwargs)
    try:
        container.start()
        status = container.wait(timeout=SELFTEST_TIMEOUT_S)
        return parse(container.logs().decode(errors="replace")), int(status.get("StatusCode", -1))
    finally:
        container.remove(force=True)


def render(rows: Sequence[NodeRow]) -> Table:
    table = Table(title="self-test")
    for col in ("node", "host", "GPU probe", "train step", "checkpoint", "network"):
        table.add_column(col)
    for rank, row in enumerate(rows):
        cells = [f"[{'green' if c.ok else 'red'}]{escape(c.text)}[/]" if c.text != "-" else "-"
                 for c in (row.gpus, row.step, row.ckpt, row.network)]
        table.add_row(str(rank), row.label, *cells)
    return table
