"""Which GPUs a job asks for, and how Docker and the trainer are told: PURE, no I/O.

`--gpus` is a count (Docker's DeviceRequest maps a count to the first N devices), `all`, 0 (CPU), or device
indices (`0,1,2,3`, `4-7`), passed as the DeviceRequest's `device_ids`: two jobs of 4 GPUs on one 8-GPU host then
get different GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from orchestrate.config import Resources
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host


def granted_here(resources: Resources, host: Host) -> Resources:
    """The job's GPU request on this host: the host's own `gpu_ids=` indices (an allocator's grant, which may differ
    from node to node) stand for `--gpus` there; in CPU mode there is nothing to grant."""
    if not host.gpu_ids or not resources.gpus:
        return resources
    return replace(resources, gpus=len(host.gpu_ids), gpu_ids=host.gpu_ids)


def grant_mismatch(resources: Resources, host: Host) -> str | None:
    """Why `--gpus` contradicts the host's own `gpu_ids=` (None: it does not). The grant stands for `--gpus` on its
    node, so a count given by hand other than the grant's (or other indices) would start as many processes as
    `--gpus` says on the GPUs the line lists: two on one GPU, or one where two were asked."""
    if not host.gpu_ids or resources.gpus in (0, GPUS_ALL):
        return None
    listed = ",".join(map(str, host.gpu_ids))
    if resources.gpu_ids and set(resources.gpu_ids) != set(host.gpu_ids):
        asked = f"--gpus {gpus_text(resources.gpu_ids)}"
    elif resources.gpus != len(host.gpu_ids):
        asked = f"--gpus {resources.gpus}"
    else:
        return None
    return (f"{host.source}: {host.label} lists gpu_ids={listed} ({len(host.gpu_ids)} GPU(s)) but {asked} was "
            f"given; leave --gpus out to use the listed GPUs, or make the line and --gpus agree")


def gpus_text(ids: Sequence[int]) -> str:
    """The indices as `--gpus` takes them back (a job file's `gpus = "4,5,6,7"`)."""
    return ",".join(map(str, ids))


def device_request(count: int, ids: Sequence[int]) -> dict[str, Any]:
    """docker-py DeviceRequest arguments: `device_ids` (strings, as the Engine API takes them) or a `count`. The
    daemon refuses a request with both, and the docker CLI sends Count 0 with `device=`."""
    if ids:
        return {"device_ids": [str(i) for i in ids], "capabilities": [["gpu"]]}
    return {"count": count, "capabilities": [["gpu"]]}


def gpus_flag(requests: list[Any] | None) -> list[str]:
    """`docker run`'s `--gpus` for the DeviceRequest. Indices are quoted: the CLI reads the value as one CSV
    record (docker/cli opts/gpus.go), so a bare `device=0,1` would split at the comma."""
    if not requests:
        return []
    ids = requests[0].get("DeviceIDs")
    if ids:
        return [f'--gpus="device={",".join(ids)}"']
    count = requests[0]["Count"]
    return ["--gpus=all"] if count == GPUS_ALL else [f"--gpus={count}"] if count else []


def trainer_device_args(cpu_mode: bool) -> tuple[str, ...]:
    """`--device cuda` for a GPU job: the trainer's `auto` would fall back to the CPU where CUDA is missing in
    the container, and train on gloo without a word. Placed before the user's options: argparse keeps the last
    `--device`, so one the user wrote after `--` wins (config.py refuses `cpu` with GPUs)."""
    return () if cpu_mode else ("--device", "cuda")


def busy_gpus(gpu_list: str, apps: str) -> dict[int, list[str]]:
    """PURE: per GPU index, the compute processes running on it (`pid name`), from `nvidia-smi
    --query-gpu=index,uuid --format=csv,noheader` (`0, GPU-8a…`) joined by UUID with `nvidia-smi
    --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader` (`GPU-8a…, 4242, python3`; no lines
    when nothing runs). A line that does not parse is skipped: this feeds a warning, never a refusal."""
    index_of: dict[str, int] = {}
    for line in gpu_list.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            index_of[parts[1]] = int(parts[0])
    busy: dict[int, list[str]] = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) >= 2 and parts[0] in index_of and parts[1].isdigit():
            name = parts[2] if len(parts) > 2 else ""
            busy.setdefault(index_of[parts[0]], []).append(f"{parts[1]} {name}".strip())
    return busy


def gpu_indices(gpu_list: str) -> list[int]:
    """PURE: the device indices `nvidia-smi --query-gpu=index,uuid --format=csv,noheader` lists."""
    return [int(line.split(",")[0]) for line in gpu_list.splitlines() if line.split(",")[0].strip().isdigit()]


def requested(count: int, ids: Sequence[int], present: Sequence[int]) -> list[int]:
    """PURE: the indices a request gets on a host: its own, every GPU (`all`), or Docker's first `count`."""
    if ids:
        return list(ids)
    ordered = sorted(present)
    return ordered if count == GPUS_ALL else ordered[:count]


def absent_indices(ids: Sequence[int], gpu_list: str) -> str | None:
    """PURE: why `--gpus` indices do not fit this host (None: they do, or none were given or listed)."""
    present = gpu_indices(gpu_list)
    missing = [i for i in ids if i not in present]
    if not present or not missing:
        return None
    return (f"--gpus {gpus_text(ids)}: GPU {gpus_text(missing)} not on this host (it has "
            f"{gpus_text(sorted(present))}); choose among those")


def busy_warning(count: int, ids: Sequence[int], gpu_list: str, apps: str) -> str | None:
    """PURE: the requested GPUs that already run a compute process (another job's, most likely), or None."""
    busy = busy_gpus(gpu_list, apps)
    hit = [i for i in requested(count, ids, gpu_indices(gpu_list)) if i in busy]
    if not hit:
        return None
    return "busy: " + "; ".join(f"GPU {i} (pid {', '.join(busy[i])})" for i in hit)
