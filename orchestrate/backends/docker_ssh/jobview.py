"""What `status` says about a job below its table: node 0's progress line, the straggler when there is one, one
line per node (its ranks' step timings from node 0's heartbeat, its GPUs' use from nvidia-smi there), or, for a
job that has ended, its last progress line labelled as the last run's, with when it ended; and its restarts."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from orchestrate.backends.docker_ssh.gpuusage import read_usage
from orchestrate.backends.docker_ssh.rfc3339 import docker_time
from orchestrate.fanout import fan_out
from orchestrate.labels import GPUS_LABEL, RANK_LABEL, RESTART_CAUSE_LABEL, RESTART_LABEL
from orchestrate.plan.jobplan import CKPT_MOUNT
from orchestrate.probe.heartbeat import Beat, hms, read_beat
from orchestrate.probe.observations import label_ids
from orchestrate.remote.session import Session

Found = Mapping[int, Sequence[Any]]  # host index -> the job's containers there (the caller's own)


def node_rank(container: Any) -> int:
    try:
        return int(container.labels.get(RANK_LABEL, "-1"))
    except ValueError:
        return -1


def folder_of(container: Any, mount: str = CKPT_MOUNT) -> str | None:
    """The host folder mounted at `mount` (the checkpoint dir, or LOG_MOUNT: the log dir)."""
    return next((str(m.get("Source")) for m in container.attrs.get("Mounts", []) if m.get("Destination") == mount),
                None)


def job_lines(nodes: Session, found: Found) -> list[str]:
    """The lines under `status`'s table ([] when node 0's container is not among `found`)."""
    node0 = next(((host, c) for host, cs in found.items() for c in cs if node_rank(c) == 0), None)
    if node0 is None:
        return []
    host, container = node0
    folder = folder_of(container)
    beat = read_beat(nodes.conn(host).read_file, folder) if folder else None
    state = container.attrs.get("State", {})
    if state.get("Status") == "running":
        lines = running_lines(beat, {node_rank(c): nodes.hosts[h].label for h, cs in found.items() for c in cs},
                              gpu_use(nodes, found))
    else:
        lines = [ended_line(beat, docker_time(state.get("FinishedAt", "")), time.time())] if beat else []
    restarts = container.labels.get(RESTART_LABEL, "0")
    if restarts not in ("", "0"):
        lines.append(f"restarts: {restarts} (last cause: {container.labels.get(RESTART_CAUSE_LABEL, '?')})")
    return lines


def running_lines(beat: Beat | None, hosts: Mapping[int, str], gpus: Mapping[int, str]) -> list[str]:
    """PURE: a running job's progress line, its straggler line (when a rank is clearly slower) and its node lines."""
    if beat is None:
        return Beat(step=0).node_lines(hosts, gpus)  # another program's, or none yet: the GPUs alone
    straggler = beat.straggler_line()
    return [f"progress: {beat.progress_line()}", *([straggler] if straggler else []), *beat.node_lines(hosts, gpus)]


def ended_line(beat: Beat, ended: float | None, now: float) -> str:
    """PURE: `last run, ended 2026-11-25 11:02:13 UTC (0h04m10s ago): step 62/62 (100%) ... done`: a job whose
    node 0 has exited is not running, and its last heartbeat is not current progress."""
    if ended is None:
        return f"last run (ended): {beat.progress_line()}"
    at = datetime.fromtimestamp(ended, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"last run, ended {at} ({hms(now - ended)} ago): {beat.progress_line()}"


def gpu_use(nodes: Session, found: Found) -> dict[int, str]:
    """Node rank -> its GPUs' use (gpuusage.py), for the nodes whose container holds GPUs. A node whose
    nvidia-smi does not answer is left out: status shows what it can."""
    held = [(host, node_rank(c), label_ids(c.labels.get(GPUS_LABEL, ""))) for host, cs in found.items() for c in cs]
    held = [h for h in held if h[2]]

    def one(item: tuple[int, int, tuple[int, ...]]) -> str | None:
        try:
            return read_usage(nodes.conn(item[0]), item[2])
        except Exception:  # noqa: BLE001  # one node's nvidia-smi failing must not hide the rest of status
            return None

    texts = fan_out("gpu use", held, one, lambda h: nodes.hosts[h[0]].label) if held else []
    return {node: text for (_, node, _), text in zip(held, texts, strict=True) if text}
