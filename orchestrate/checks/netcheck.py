"""The network check (`check`, `up --check-network`): bandwidth between the nodes in the job's image, with the
job's network settings, before a job runs; the slow node or link named.

One container per node runs trainer/bandwidth.py (passed as `python3 -c`, so any image with torch does) with
the job's interface settings and rendezvous address: all_reduce bus bandwidth over all nodes (1 MB up to
--max-mb, gloo on CPU, NCCL on GPU), then a ping-pong between every pair of nodes (up to PAIRS_UP_TO nodes).
A node is the outlier when its best pair is below OUTLIER_FRACTION of the median node's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrate.apply.start import start_containers
from orchestrate.errors import JobError
from orchestrate.jobs.control import kill_on_host, uid_of
from orchestrate.jobs.owner import OWNER_LABEL, container_name
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.remote.docker import JOB_LABEL
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out

OUTLIER_FRACTION = 0.5
PAIRS_UP_TO = 8  # every pair of up to this many nodes (28 pairs); above, the all-node figure only
JOIN_TIMEOUT_S = 30.0  # a node that cannot reach the master says so after this long
MARK = "NETCHECK "


@dataclass(frozen=True)
class NodeResult:
    rank: int
    label: str
    exit_code: int | None
    payload: dict[str, Any] | None  # the node's NETCHECK line (None: it printed none)


@dataclass(frozen=True)
class Verdict:
    """PURE result of one check: figures, and whom to blame."""

    allreduce_gbps: float | None  # bus bandwidth at the largest size measured, all nodes
    pairs: dict[tuple[int, int], float]
    node_best: dict[int, float]  # per node, its best pair (GB/s one way)
    outliers: list[int]
    cannot_join: dict[int, str]  # node -> why it did not take part


def judge(results: Sequence[NodeResult]) -> Verdict:
    """PURE: the nodes that could not join, the all-node figure, the pairs and the outlier nodes."""
    cannot = {r.rank: str((r.payload or {}).get("error") or f"no result (exit code {r.exit_code})")
              for r in results if not r.payload or "error" in r.payload}
    # A node that cannot reach the master is the cause; the others then time out waiting for it.
    unreachable = {n: why for n, why in cannot.items() if (results[n].payload or {}).get("kind") == "unreachable"}
    head = next((r.payload for r in results if r.rank == 0 and r.payload and "error" not in r.payload), None)
    if head is None:
        return Verdict(None, {}, {}, [], unreachable or cannot)
    sizes = head.get("allreduce") or []
    allreduce = float(sizes[-1]["busbw_gbps"]) if sizes else None
    pairs = {(int(p["a"]), int(p["b"])): float(p["gbps"]) for p in head.get("pairs") or []}
    best: dict[int, float] = {}
    for (a, b), gbps in pairs.items():
        for n in (a, b):
            best[n] = max(best.get(n, 0.0), gbps)
    return Verdict(allreduce, pairs, best, outliers(best), {})


def outliers(best: dict[int, float]) -> list[int]:
    """PURE: nodes whose best pair is below OUTLIER_FRACTION of the median node's. Two nodes share their only
    pair, so there is nothing to compare: no outlier."""
    if len(best) < 3:
        return []
    median = statistics.median(best.values())
    return sorted(n for n, gbps in best.items() if gbps < OUTLIER_FRACTION * median)


def script() -> str:
    spec = importlib.util.find_spec("trainer.bandwidth")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as fh:
        return fh.read()


def check_specs(specs: Sequence[NodeSpec], max_mb: int) -> list[NodeSpec]:
    """PURE: the job's containers turned into the check's: same image, host network, interface settings and
    master; one process per node, no mounts, the check's own name and job label (`kill --job JOB-netcheck`)."""
    job = f"{specs[0].labels[JOB_LABEL]}-netcheck"
    n = len(specs)
    command = ("python3", "-c", script(), "--max-mb", str(max_mb), "--timeout", str(JOIN_TIMEOUT_S),
               *(("--pairs",) if n <= PAIRS_UP_TO else ()))
    return [dataclasses.replace(s, name=container_name(job, s.rank, s.labels.get(OWNER_LABEL)), command=command, mounts=(),
                                env={**s.env, "RANK": str(s.rank), "WORLD_SIZE": str(n), "LOCAL_RANK": "0"},
                                labels={**s.labels, JOB_LABEL: job}) for s in specs]


def measure(nodes: Nodes, specs: Sequence[NodeSpec], max_mb: int, console: Console) -> Verdict:
    """Run the check once (bounded), print its table, remove its containers; the verdict."""
    checks = check_specs(specs, max_mb)
    console.print(f"network check: {len(checks)} node(s), all_reduce 1-{max_mb} MB"
                  + (", then every pair" if len(checks) <= PAIRS_UP_TO else ""), markup=False)
    containers = start_containers(nodes, checks)
    try:
        results = fan_out("network check", list(range(len(checks))),
                          lambda r: _result(containers[r], r, checks[r].host.label), lambda r: checks[r].host.label)
    finally:
        fan_out("network check cleanup", list(range(len(checks))),
                lambda r: kill_on_host(nodes.docker(r), checks[r].labels[JOB_LABEL], 0, checks[r].host.label,
                                         uid_of(nodes, r)),
                lambda r: checks[r].host.label)
    verdict = judge(results)
    console.print(render(verdict, [s.host.label for s in checks]))
    for n in verdict.outliers:
        console.print(f"[bold yellow]outlier: node {n} ({checks[n].host.label}): best pair "
                      f"{verdict.node_best[n] * 1000:.1f} MB/s, below {OUTLIER_FRACTION:.0%} of the median node's[/]")
    return verdict


def _result(container: Any, rank: int, label: str) -> NodeResult:
    # Bounded: the join timeout, then the measurements (each capped by the program's time budget).
    status = container.wait(timeout=JOIN_TIMEOUT_S + 600)
    lines = container.logs().decode(errors="replace").splitlines()
    payload = None
    for line in lines:
        if line.startswith(MARK):
            try:
                payload = dict(json.loads(line[len(MARK):]))
            except ValueError:
                payload = None
    return NodeResult(rank, label, int(status.get("StatusCode", -1)), payload)


def render(verdict: Verdict, labels: Sequence[str]) -> Table:
    """Per node its best pair, then every pair (MB/s one way), the all-node all_reduce bus bandwidth below."""
    caption = (f"all {len(labels)} nodes: all_reduce bus bandwidth {verdict.allreduce_gbps * 1000:.1f} MB/s"
               if verdict.allreduce_gbps is not None else None)
    table = Table(title="network check (MB/s)", caption=caption)
    for col in ("node", "host", "MB/s", "result"):
        table.add_column(col, overflow="ellipsis")
    for n, label in enumerate(labels):
        if n in verdict.cannot_join:
            result = f"[red]cannot join: {verdict.cannot_join[n][:60]}[/]"
        else:
            result = "[yellow]OUTLIER[/]" if n in verdict.outliers else "ok" if not verdict.cannot_join else "-"
        best = f"{verdict.node_best[n] * 1000:.1f} (best pair)" if n in verdict.node_best else "-"
        table.add_row(str(n), label, best, result)
    for (a, b), gbps in sorted(verdict.pairs.items()):
        table.add_row(f"{a}-{b}", f"{labels[a]} <-> {labels[b]}", f"{gbps * 1000:.1f}", "")
    return table


def require_all_joined(verdict: Verdict, labels: Sequence[str]) -> None:
    """`up --check-network` starts nothing when a node could not take part."""
    if verdict.cannot_join:
        lines = "; ".join(f"node {n} ({labels[n]}): {why}" for n, why in sorted(verdict.cannot_join.items()))
        raise JobError(f"network check: {lines}; nothing was started (check the interface and firewalls)")
