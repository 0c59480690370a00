"""Owned jobs on shared hosts: every container carries its owner, the SSH login's uid and name on that host.

`status`, `logs`, `kill`, `plot`, `--replace` and `--resume` see only the caller's containers, so two people can
both run a job called `cifar`; another person's job is never stopped or replaced (docs/shared-hosts.md).
Containers of older versions, which carry no owner label, count as the caller's (migration).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from orchestrate.backends.protocol import JobRow
from orchestrate.fanout import fan_out
from orchestrate.labels import GPUS_LABEL, JOB_LABEL, RANK_LABEL, is_mine, owner_text
from orchestrate.remote.docker import job_containers
from orchestrate.remote.session import Session


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


def find_jobs(nodes: Session) -> list[JobRow]:
    """`status --all`: every owner's jobs on the reachable hosts, one row each."""
    per_host = fan_out("status --all", nodes.reachable(),
                       lambda r: [(nodes.hosts[r].label, c) for c in all_job_containers(nodes.docker(r))],
                       lambda r: nodes.hosts[r].label)
    return job_rows([pair for chunk in per_host for pair in chunk])
