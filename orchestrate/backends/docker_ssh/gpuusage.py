"""Each node's GPU use for `status`: nvidia-smi's utilisation and memory of the GPUs the job holds there, read
over the node's existing SSH connection (remote/scripts/gpu_usage.sh). No GPU ran here: the parser is pinned by
tests on nvidia-smi's documented CSV output (tests/orchestrate/test_node_view.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection

GPU_USAGE = scripts.text("gpu_usage.sh")


@dataclass(frozen=True)
class GpuUse:
    index: int
    util: int | None  # percent busy over nvidia-smi's last sample period; None: "[N/A]" (some MIG and vGPU setups)
    used_mib: int | None
    total_mib: int | None


def _number(text: str) -> int | None:
    """`35`, or `35 %` / `1234 MiB` (units left in: a simulated or older nvidia-smi); None for [N/A]."""
    word = text.strip().split(" ")[0]
    return int(word) if word.isdigit() else None


def parse_usage(text: str) -> list[GpuUse]:
    """PURE: the rows of `nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total
    --format=csv,noheader,nounits`; lines that are not such a row (a warning, an error) are left out."""
    rows = []
    for line in text.splitlines():
        cells = line.split(",")
        if len(cells) == 4 and cells[0].strip().isdigit():
            util, used, total = (_number(c) for c in cells[1:])
            rows.append(GpuUse(int(cells[0]), util, used, total))
    return rows


def usage_text(rows: Sequence[GpuUse], held: Sequence[int]) -> str | None:
    """PURE: `GPU 0-3 91-98% busy, 283/318 GiB` (memory used/total): the GPUs the job holds on the node (`held`, host device
    indices); None when it holds none or nvidia-smi listed none of them."""
    mine = [r for r in rows if r.index in held]
    if not mine:
        return None
    utils = [r.util for r in mine if r.util is not None]
    busy = "?" if not utils else f"{min(utils)}%" if min(utils) == max(utils) else f"{min(utils)}-{max(utils)}%"
    used, total = (sum(v for v in vals if v is not None) for vals in
                   ([r.used_mib for r in mine], [r.total_mib for r in mine]))
    return f"GPU {index_ranges([r.index for r in mine])} {busy} busy, {used / 1024:.0f}/{total / 1024:.0f} GiB"


def index_ranges(indices: Sequence[int]) -> str:
    """PURE: `0-3,6` for [0, 1, 2, 3, 6]."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def read_usage(conn: Connection, held: Sequence[int]) -> str | None:
    """The node's GPU use as usage_text says it; None on a CPU node (no GPU held), where nothing is asked."""
    if not held:
        return None
    return usage_text(parse_usage(conn.run(["sh", "-c", GPU_USAGE, "gpu_usage"], timeout=30).out), held)
