"""Owned jobs on shared hosts: every container carries its owner, the SSH login's uid and name on that host.

`status`, `logs`, `kill`, `plot`, `--replace` and `--resume` see only the caller's containers, so two people can
both run a job called `cifar`; another person's job is never stopped or replaced (docs/shared-hosts.md).
Containers of older versions, which carry no owner label, count as the caller's (migration).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrate.remote.docker import GPUS_LABEL, JOB_LABEL, RANK_LABEL, job_containers
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out

OWNER_LABEL = "ddp-cifar.owner"  # the login's name on the host
OWNER_UID_LABEL = "ddp-cifar.owner-uid"  # its uid there: the one that decides (names can be reused)
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def owner_labels(user: str | None, login: str | None) -> dict[str, str]:
    """PURE: the owner labels of a container run as `user` ("uid:gid", preflight's), none when not known yet
    (an offline dry run)."""
    if user is None:
        return {}
    return {OWNER_UID_LABEL: user.split(":", 1)[0], OWNER_LABEL: login or ""}


def is_mine(labels: Mapping[str, str], uid: int) -> bool:
    """PURE: whether a container belongs to the login `uid`; one without an owner label (an older version's)
    does."""
    owner = labels.get(OWNER_UID_LABEL)
    return owner is None or owner == str(uid)


def owner_text(labels: Mapping[str, str]) -> str:
    """PURE: who owns a container, for one line: `bob (uid 1001)`."""
    uid = labels.get(OWNER_UID_LABEL)
    if uid is None:
        return "an older version (no owner label)"
    return f"{labels.get(OWNER_LABEL) or '?'} (uid {uid})"


def container_name(job: str, rank: int, login: str | None) -> str:
    """PURE: the container's name; with the login in it, two people's jobs of the same name do not clash
    (a name is unique per Docker daemon)."""
    if not login:
        return f"{job}-node{rank}"
    return f"{job}-node{rank}-{_NAME_UNSAFE.sub('_', login)}"


def mine(client: Any, job: str, uid: int) -> list[Any]:
    """The job's containers on a host that belong to the login `uid`."""
    return [c for c in job_containers(client, job) if is_mine(c.labels, uid)]


def others_line(job: str, found: Iterable[Any], uid: int) -> str | None:
    """PURE: one line naming the other owners of a job of this name, None when there are none."""
    owners = sorted({owner_text(c.labels) for c in found if not is_mine(c.labels, uid)})
    if not owners:
        return None
    return f"job {job!r} here belongs to {', '.join(owners)}, not to you: left alone"


# ---- status --all ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    """One job of one owner on the hosts, as `status --all` shows it."""

    owner: str
    job: str
    nodes: str  # host labels, node rank order
    gpus: str
    age: str
    running: int  # containers running, of `containers`
    containers: int


def gpus_of(attrs: Mapping[str, Any]) -> str:
    """PURE: the GPUs a container holds: its GPU-set label (also on a simulated host, where Docker gets no
    request), else what it asked Docker for (its device requests): `all`, a count, device IDs, or `-`."""
    held = ((attrs.get("Config") or {}).get("Labels") or {}).get(GPUS_LABEL)
    if held:
        return held
    parts: list[str] = []
    for req in (attrs.get("HostConfig") or {}).get("DeviceRequests") or []:
        if req.get("DeviceIDs"):
            parts.append(",".join(req["DeviceIDs"]))
        elif req.get("Count") == -1:
            parts.append("all")
        elif req.get("Count"):
            parts.append(str(req["Count"]))
    return "+".join(parts) or "-"


def age(created: str, now: datetime) -> str:
    """PURE: how long ago Docker's `Created` time was, as 1d02h, 3h04m or 5m06s."""
    try:
        then = datetime.fromisoformat(created[:26].rstrip("Z") + "+00:00")
    except ValueError:
        return "?"
    seconds = max(int((now - then).total_seconds()), 0)
    days, hours, minutes = seconds // 86400, seconds % 86400 // 3600, seconds % 3600 // 60
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds % 60:02d}s"


def job_rows(found: Sequence[tuple[str, Any]], now: datetime | None = None) -> list[JobRow]:
    """PURE: (host label, container) of every job container on the hosts → one row per (owner, job)."""
    now = now or datetime.now(timezone.utc)
    groups: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    for label, c in found:
        groups.setdefault((owner_text(c.labels), c.labels.get(JOB_LABEL, "?")), []).append((label, c))
    rows = []
    for (owner, job), members in sorted(groups.items()):
        members.sort(key=lambda m: int(m[1].labels.get(RANK_LABEL, "0") or 0))
        oldest = min(m[1].attrs.get("Created", "") for m in members)
        rows.append(JobRow(owner, job, " ".join(dict.fromkeys(m[0] for m in members)),
                           " ".join(gpus_of(m[1].attrs) for m in members), age(oldest, now),
                           sum(m[1].status == "running" for m in members), len(members)))
    return rows


def all_job_containers(client: Any) -> list[Any]:
    """Every container on a host that carries a job label, whoever owns it."""
    return [c for c in client.containers.list(all=True, filters={"label": JOB_LABEL}, ignore_removed=True) if JOB_LABEL in c.labels]


def print_all_jobs(nodes: Nodes, console: Console, unreachable: Mapping[str, str]) -> bool:
    """`status --all`: every owner's jobs on the reachable hosts, one row each; False if a host was unreachable."""
    per_host = fan_out("status --all", nodes.reachable(),
                       lambda r: [(nodes.hosts[r].label, c) for c in all_job_containers(nodes.docker(r))],
                       lambda r: nodes.hosts[r].label)
    table = Table(title="jobs on these hosts (everyone's)")
    for col in ("owner", "job", "nodes", "GPUs", "age", "running"):
        table.add_column(col, overflow="fold")
    for row in job_rows([pair for chunk in per_host for pair in chunk]):
        table.add_row(*(Text(cell) for cell in (row.owner, row.job, row.nodes, row.gpus, row.age,
                                                 f"{row.running}/{row.containers}")))
    console.print(table)
    for label, why in sorted(unreachable.items()):
        console.print(f"{label}: UNREACHABLE ({why[:80]})", markup=False, highlight=False)
    return not unreachable
