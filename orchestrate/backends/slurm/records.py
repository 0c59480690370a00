"""PURE: what Slurm's clients print (22.05 formats, tests/orchestrate/data/slurm/) → plain data.

`scontrol show job -d` is read rather than `squeue` or `sacct`: it answers for a job of any state while the
controller keeps it (MinJobAge), and it needs no accounting database."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrate.errors import ConfigError
from orchestrate.hosts import indices

_FIELD = re.compile(r"(\w[\w/:]*)=(\S*)")
# One `Nodes=` line per group of nodes with the same grant: `Nodes=n[0-1] CPU_IDs=0 Mem=64 GRES=gpu:1(IDX:0)`;
# a typed GPU reads `gpu:a100:2(IDX:0-1)`, and other gres follow after a comma.
_NODES_LINE = re.compile(r"^\s*Nodes=(\S+)\s.*$", re.MULTILINE)
_GPU_IDX = re.compile(r"(?:^|[=,])gpu(?::[^:(,\s]+)*\(IDX:([0-9,\-]*)\)")
_BRACKET = re.compile(r"^([^\[\],]*)\[([^\]]+)\](.*)$")
# States in which the job holds or waits for its nodes (a second submit of its name is refused).
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"})


@dataclass(frozen=True)
class JobRecord:
    """One job as `scontrol show job -d` describes it."""

    job_id: str
    name: str
    user: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    reason: str  # why it is pending (Resources, Priority, ...); "None" otherwise
    exit_code: str  # "3:0": the batch script's status, then the signal that ended it
    node_list: str  # Slurm's compressed form, e.g. dc-x-h[0-1]; empty while pending
    gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node → the GPU indices granted there

    def describe(self) -> str:
        """One cell: `PENDING (Resources)`, `RUNNING on n[0-1]`, `FAILED (exit 3)`."""
        if self.state == "PENDING":
            return f"PENDING ({self.reason})"
        if self.state == "RUNNING":
            return f"RUNNING on {self.node_list}"
        status, _, signal = self.exit_code.partition(":")
        if self.state == "COMPLETED" or status == signal == "0":
            return self.state
        return f"{self.state} (exit {status}" + (f", signal {signal})" if signal not in ("", "0") else ")")


def parse_job(text: str) -> JobRecord:
    """The first job of `scontrol show job -d` output."""
    fields: dict[str, str] = {}
    for key, value in _FIELD.findall(text.split("\n\n", 1)[0]):
        fields.setdefault(key, value)
    if "JobId" not in fields:
        raise ConfigError(f"scontrol printed no job record: {' '.join(text.split())[:160]!r}")
    return JobRecord(job_id=fields["JobId"], name=fields.get("JobName", ""),
                     user=fields.get("UserId", "").split("(", 1)[0], state=fields.get("JobState", "UNKNOWN"),
                     reason=fields.get("Reason", "None"), exit_code=fields.get("ExitCode", "0:0"),
                     node_list=fields.get("NodeList", ""), gpus=gpus_by_node(text))


def kill_wait(config_text: str) -> int | None:
    """KillWait (seconds) from `scontrol show config`: how long Slurm waits between a job's SIGTERM and SIGKILL."""
    match = re.search(r"^KillWait\s*=\s*(\d+) sec", config_text, re.MULTILINE)
    return int(match.group(1)) if match else None


def parse_jobs(text: str) -> list[JobRecord]:
    """Every job of `scontrol show job -d` (records are separated by blank lines), oldest first."""
    jobs = [parse_job(part) for part in text.split("\n\n") if "JobId=" in part]
    return sorted(jobs, key=lambda r: int(r.job_id) if r.job_id.isdigit() else 0)


def hosts_text(job_id: str, nodes: list[str], gpus: dict[str, tuple[int, ...]]) -> tuple[str, int]:
    """The allocation as a hosts file: one node a line in Slurm's order, `gpu_ids=` its granted indices; and the
    GPUs per node. The nodes must have the same number of GPUs: a data-parallel job runs as many ranks on each."""
    counts = {len(gpus.get(n, ())) for n in nodes}
    if len(counts) > 1:
        uneven = ", ".join(f"{n}: {len(gpus.get(n, ()))}" for n in nodes)
        raise ConfigError(f"Slurm job {job_id} holds different numbers of GPUs per node ({uneven}); ask for the same "
                          "number on each (--gpus-per-node)")
    per_node = counts.pop() if counts else 0
    lines = [f"# Slurm job {job_id}: its nodes in Slurm's order (node 0 first), with the GPUs granted on each\n"]
    for node in nodes:
        ids = gpus.get(node, ())
        lines.append(f"{node} slots={len(ids)} gpu_ids={','.join(map(str, ids))}\n" if ids else f"{node}\n")
    return "".join(lines), per_node


def gpus_by_node(text: str) -> dict[str, tuple[int, ...]]:
    """The GPU indices granted on each node, from the detailed record's `Nodes=... GRES=gpu...(IDX:...)` lines;
    a node without such a line got no GPU."""
    grants: dict[str, tuple[int, ...]] = {}
    for match in _NODES_LINE.finditer(text):
        line = match.group(0)
        gres = line.split(" GRES=", 1)[1] if " GRES=" in line else ""
        ids = tuple(i for idx in _GPU_IDX.findall("=" + gres) for i in indices(idx))
        for node in expand_hostlist(match.group(1)):
            grants[node] = ids
    return grants


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax, in its order: `n[0-2,5],gpu07` → n0 n1 n2 n5 gpu07; zero padding kept (n[08-10]).
    The same as `scontrol show hostnames`, for the lines of a record (the node list itself is expanded by Slurm)."""
    names: list[str] = []
    for item in _split_top(text):
        match = _BRACKET.match(item)
        if match is None:
            names.append(item)
            continue
        head, ranges, tail = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            names.extend(f"{head}{str(n).zfill(width)}{rest}" for n in range(int(first), int(last or first) + 1)
                         for rest in expand_hostlist(tail) or [""])
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for pos, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:pos])
            start = pos + 1
    items.append(text[start:])
    return [i for i in items if i]
