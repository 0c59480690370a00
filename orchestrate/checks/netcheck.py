"""The network check (`check`, `up --check-network`): bandwidth within each node and between the nodes in the
job's image, with the job's network settings and process count, before a job runs; the slow node or link named,
and NCCL's own word on the transport it used.

One container per node runs trainer/bandwidth.py (passed as `python3 -c`, so any image with torch does) with the
job's interface settings and rendezvous address. It forks the job's processes of that node (one per GPU; on CPU
nodes at least 2, see `processes`) and measures all_reduce bus bandwidth among each node's own processes, then
over every process of every node (1 MB up to --max-mb, gloo on CPU, NCCL on GPU), then a ping-pong between
every pair of nodes (up to PAIRS_UP_TO nodes). A node fails the check when:
- it is the outlier: its best pair is below OUTLIER_FRACTION of the median node's (3 nodes or more);
- a figure is below its floor: `--min-busbw` (across nodes) and `--min-node-busbw` (within a node), by default
  FLOOR_GBPS of the transport that carried it;
- NCCL's log names another network than the plan's: IB planned and Socket used, or sockets planned and IB used;
- NCCL used IB without GPUDirect RDMA (no `/GDRDMA` in its NET/IB channel lines).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from orchestrate.backends.protocol import Scheduler, ShortRunResult
from orchestrate.config import Checks, Resources
from orchestrate.errors import JobError
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.plan.shortlived import JOIN_TIMEOUT_S, PAIRS_UP_TO
from orchestrate.plan.transport import IB_DEVICE_DIR
from trainer.transport import NcclPaths, nccl_paths

NodesT = TypeVar("NodesT")  # the scheduler's connection to the nodes: the check only hands it back to the scheduler
OUTLIER_FRACTION = 0.5
MARK = "NETCHECK "
# Default floors of all_reduce bus bandwidth (GB/s), by the transport that carried it: far below healthy hardware
# of that kind, far above a broken path. A 100 Gb/s IB or RoCE port gives ~12 GB/s, 8 of them ~90 per GPU pair;
# NCCL over 1 GbE sockets ~0.1; NVLink hundreds within a node, PCIe P2P or SHM through host memory ~5-20.
# gloo's floor only catches a stalled link: the test hosts' throttled veths give a few MB/s.
FLOOR_GBPS = {"ib": 2.0, "socket": 0.05, "nccl-node": 2.0, "gloo": 0.001}
# Within a node, NCCL on GPUs of a model whose 8 GPUs share an NVSwitch fabric: a floor near a third of a healthy
# node's all_reduce bus bandwidth (H100/H200 SXM, NVLink 4, 900 GB/s per GPU: ~360-480 GB/s measured by
# nccl-tests' all_reduce_perf; A100 SXM, NVLink 3, 600 GB/s: ~230), far above what a fallback gives (SHM through
# host memory ~5-20, PCIe P2P up to ~50). Matched as substrings of the GPU's name, most specific first, with the
# names of trainer/hardware.py's PEAK_TFLOPS (kept in step by a test); None: no NVSwitch (NVL bridges pair GPUs,
# PCIe cards have none): the transport's floor.
NODE_FLOOR_BY_GPU: tuple[tuple[str, float | None], ...] = (
    ("H200 NVL", None), ("H200", 150.0), ("H100 NVL", None), ("H100 PCIe", None), ("H100", 150.0),
    ("A100-SXM", 80.0), ("A100", None), ("L40S", None))
CAUSES = ("unreachable", "no-cuda")  # a node that failed for one of these is the cause; its peers then time out


@dataclass(frozen=True)
class Floors:
    across: float | None = None  # --min-busbw (GB/s); None: FLOOR_GBPS of the network used
    within: float | None = None  # --min-node-busbw (GB/s); None: FLOOR_GBPS of NCCL within a node, or gloo's


@dataclass(frozen=True)
class Options:
    """What the check is told: the largest message, CPU (gloo) or GPU (NCCL), the floors."""

    max_mb: int
    cpu: bool
    floors: Floors = Floors()

    @classmethod
    def of(cls, checks: Checks, resources: Resources) -> Options:
        return cls(checks.check_max_mb, resources.cpu_mode, Floors(checks.check_min_busbw, checks.check_min_node_busbw))


@dataclass(frozen=True)
class NodeResult:
    rank: int
    label: str
    exit_code: int | None
    payload: dict[str, Any] | None  # the node's NETCHECK line (None: it printed none)


@dataclass(frozen=True)
class Verdict:
    """PURE result of one check: figures, and whom to blame."""

    allreduce_gbps: float | None  # bus bandwidth at the largest size measured, every process of every node
    pairs: dict[tuple[int, int], float]
    node_best: dict[int, float]  # per node, its best pair (GB/s one way)
    outliers: list[int]
    cannot_join: dict[int, str]  # node -> why it did not take part
    within_gbps: dict[int, float] = field(default_factory=dict)  # per node: among its own processes
    paths: dict[int, NcclPaths] = field(default_factory=dict)  # per node: what NCCL's log says it used
    problems: dict[int, list[str]] = field(default_factory=dict)  # per node: a floor missed, a transport not planned
    gpus: dict[int, str] = field(default_factory=dict)  # per node: its GPU's name (NCCL runs only)


def judge(results: Sequence[NodeResult], planned: str = "gloo", floors: Floors = Floors()) -> Verdict:
    """PURE: the nodes that could not join, the figures, the outliers, and each node's problems."""
    cannot = {r.rank: str((r.payload or {}).get("error") or f"no result (exit code {r.exit_code})")
              for r in results if not r.payload or "error" in r.payload}
    # A node that cannot reach the master (or has no CUDA) is the cause; the others then time out waiting for it.
    causes = {n: why for n, why in cannot.items() if (results[n].payload or {}).get("kind") in CAUSES}
    head = next((r.payload for r in results if r.rank == 0 and r.payload and "error" not in r.payload), None)
    if head is None or cannot:
        return Verdict(None, {}, {}, [], causes or cannot)
    pairs = {(int(p["a"]), int(p["b"])): float(p["gbps"]) for p in head.get("pairs") or []}
    best: dict[int, float] = {}
    for (a, b), gbps in pairs.items():
        for n in (a, b):
            best[n] = max(best.get(n, 0.0), gbps)
    payloads = {r.rank: r.payload for r in results if r.payload}
    within = {n: g for n, p in payloads.items() if (g := _last(p.get("within"))) is not None}
    paths = {n: nccl_paths(list(p["nccl"])) for n, p in payloads.items() if "nccl" in p}
    gpus = {n: str(p["gpu"]) for n, p in payloads.items() if p.get("gpu")}
    verdict = Verdict(_last(head.get("allreduce")), pairs, best, outliers(best), {}, within, paths, gpus=gpus)
    return dataclasses.replace(verdict, problems=problems(verdict, len(results), planned, floors))


def _last(sizes: list[dict[str, float]] | None) -> float | None:
    """The bus bandwidth at the largest size measured (None: not measured)."""
    return float(sizes[-1]["busbw_gbps"]) if sizes else None


def outliers(best: dict[int, float]) -> list[int]:
    """PURE: nodes whose best pair is below OUTLIER_FRACTION of the median node's. Two nodes share their only
    pair, so there is nothing to compare: no outlier (the floor still applies)."""
    if len(best) < 3:
        return []
    median = statistics.median(best.values())
    return sorted(n for n, gbps in best.items() if gbps < OUTLIER_FRACTION * median)


def problems(v: Verdict, nnodes: int, planned: str, floors: Floors) -> dict[int, list[str]]:
    """PURE: per node, the transport that is not the plan's and the figures below their floor. A slow all-node
    figure is blamed on the outliers when there are some, else on every node (with 2 nodes, nothing tells which)."""
    found: dict[int, list[str]] = {}
    for n, paths in v.paths.items():
        why = transport_problem(planned, paths, nnodes)
        if why:
            found.setdefault(n, []).append(why)
    for n, gbps in v.within_gbps.items():
        floor = floors.within if floors.within is not None else node_floor(planned, v.gpus.get(n))
        if gbps < floor:
            found.setdefault(n, []).append(f"within the node {rate(gbps)}, below the floor {rate(floor)}")
    floor = floors.across if floors.across is not None else FLOOR_GBPS[network_kind(planned, v.paths)]
    if v.allreduce_gbps is not None and v.allreduce_gbps < floor:
        for n in v.outliers or range(nnodes):
            found.setdefault(n, []).append(f"across nodes {rate(v.allreduce_gbps)}, below the floor {rate(floor)}")
    return found


def node_floor(planned: str, gpu: str | None) -> float:
    """PURE: the default floor within a node: its GPU model's (NODE_FLOOR_BY_GPU) on NCCL, else the transport's."""
    if planned == "gloo":
        return FLOOR_GBPS["gloo"]
    by_model = next((floor for key, floor in NODE_FLOOR_BY_GPU if gpu and key in gpu), None)
    return by_model if by_model is not None else FLOOR_GBPS["nccl-node"]


def network_kind(planned: str, paths: dict[int, NcclPaths]) -> str:
    """PURE: which FLOOR_GBPS the all-node figure answers to: gloo's, IB's when NCCL used IB on every node, else
    sockets' (an external plugin's speed is not known here)."""
    if planned == "gloo":
        return "gloo"
    nets = [p.net for p in paths.values()]
    return "ib" if nets and all(net is not None and net.startswith("IB") for net in nets) else "socket"


def transport_problem(planned: str, paths: NcclPaths, nnodes: int) -> str | None:
    """PURE: why the network NCCL used is not the plan's (None: it is, or there is none between the nodes)."""
    if nnodes < 2 or paths.net is None:
        return None
    if planned == "ib" and paths.net == "Socket":
        return f"InfiniBand planned, but NCCL used {paths.said or 'sockets'} (is /dev/infiniband in the container?)"
    if planned == "socket" and paths.net != "Socket":
        return f"sockets planned (NCCL_IB_DISABLE=1), but NCCL used {paths.said or paths.net}"
    if paths.net.startswith("IB") and not paths.gdrdma:
        return (f"NCCL used {paths.said or paths.net} without GPUDirect RDMA (no GDRDMA in its NET/IB channel "
                "lines): every transfer is staged through host memory; is the nvidia-peermem module loaded on "
                "the host, and NCCL_NET_GDR_LEVEL not lowered?")
    return None


def planned_transport(spec: ContainerSpec, cpu: bool) -> str:
    """PURE: the network the plan gave the containers: gloo (CPU), ib (the verbs devices), socket (NCCL told to
    leave IB alone), or auto (NCCL decides: a user's own NCCL_IB_DISABLE, or an offline plan)."""
    if cpu:
        return "gloo"
    if IB_DEVICE_DIR in spec.devices and spec.env.get("NCCL_IB_DISABLE", "0") == "0":
        return "ib"
    return "socket" if spec.env.get("NCCL_IB_DISABLE") == "1" else "auto"


def rate(gbps: float) -> str:
    """GB/s from 1 GB/s up, MB/s below (the CPU test hosts' figures)."""
    return f"{gbps:.1f} GB/s" if gbps >= 1 else f"{gbps * 1000:.1f} MB/s"


def script() -> str:
    spec = importlib.util.find_spec("trainer.bandwidth")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as fh:
        return fh.read()


def measure(scheduler: Scheduler[NodesT], nodes: NodesT, checks: Sequence[ContainerSpec], options: Options,
            console: Console) -> Verdict:
    """Run the check's containers as planned (plan/shortlived.py) once (bounded), print its table and each failure
    in a line, remove its containers; the verdict."""
    console.print(f"network check: {len(checks)} node(s), processes per node {checks[0].command[4]}, all_reduce "
                  f"1-{options.max_mb} MB within each node, then across nodes"
                  + (", then every pair" if len(checks) <= PAIRS_UP_TO else ""), markup=False)
    # Bounded: the join timeout, then the measurements (each capped by the program's time budget).
    ran = scheduler.run(nodes, dict(enumerate(checks)), JOIN_TIMEOUT_S + 600, "network check", together=True)
    results = [_result(ran[r], r, checks[r].host.label) for r in range(len(checks))]
    verdict = judge(results, planned_transport(checks[0], options.cpu), options.floors)
    console.print(render(verdict, [s.host.label for s in checks]))
    for n in verdict.outliers:
        console.print(f"[bold yellow]outlier: node {n} ({checks[n].host.label}): best pair "
                      f"{rate(verdict.node_best[n])}, below {OUTLIER_FRACTION:.0%} of the median node's[/]")
    for n, whys in sorted(verdict.problems.items()):
        console.print(f"[bold red]node {n} ({checks[n].host.label}): {'; '.join(whys)}[/]")
    return verdict


def _result(ran: ShortRunResult, rank: int, label: str) -> NodeResult:
    """The node's line; a process's error line first (the node's first process may only have seen its peers go)."""
    payloads: list[dict[str, Any] | None] = []
    for line in ran.output.splitlines():
        if line.startswith(MARK):
            try:
                payloads.append(dict(json.loads(line[len(MARK):])))
            except ValueError:
                continue
    failed = [p for p in payloads if p and "error" in p]
    return NodeResult(rank, label, ran.exit_code, (failed or payloads or [None])[0])


def render(verdict: Verdict, labels: Sequence[str]) -> Table:
    """Per node: all_reduce within it, its best pair, what NCCL used; every pair below; the all-node figure in
    the caption."""
    caption = (f"all {len(labels)} nodes: all_reduce bus bandwidth {rate(verdict.allreduce_gbps)}"
               if verdict.allreduce_gbps is not None else None)
    table = Table(title="network check", caption=caption)
    for col in ("node", "host", "within node", "best pair", "NCCL used", "result"):
        table.add_column(col, overflow="ellipsis")
    for n, label in enumerate(labels):
        table.add_row(str(n), label, rate(verdict.within_gbps[n]) if n in verdict.within_gbps else "-",
                      rate(verdict.node_best[n]) if n in verdict.node_best else "-",
                      path_text(verdict.paths[n]) if n in verdict.paths else "-", _result_text(verdict, n))
    for (a, b), gbps in sorted(verdict.pairs.items()):
        table.add_row(f"{a}-{b}", f"{labels[a]} <-> {labels[b]}", "", rate(gbps), "", "")
    return table


def path_text(paths: NcclPaths) -> str:
    """PURE: e.g. `IB, P2P/CUMEM, NVLS` (the network first, then what ran within the node)."""
    return ", ".join([*([paths.net] if paths.net else []), *paths.local]) or "did not say"


def _result_text(verdict: Verdict, n: int) -> str:
    if n in verdict.cannot_join:
        return f"[red]cannot join: {verdict.cannot_join[n][:60]}[/]"
    if n in verdict.problems:
        return "[red]FAILED[/]"
    return "[yellow]OUTLIER[/]" if n in verdict.outliers else "ok" if not verdict.cannot_join else "-"


def require_all_joined(verdict: Verdict, labels: Sequence[str]) -> None:
    """`up --check-network` starts nothing when a node could not take part."""
    if verdict.cannot_join:
        lines = "; ".join(f"node {n} ({labels[n]}): {why}" for n, why in sorted(verdict.cannot_join.items()))
        raise JobError(f"network check: {lines}; nothing was started (check the interface and firewalls)")
