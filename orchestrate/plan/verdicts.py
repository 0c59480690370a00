"""PURE: preflight's verdicts on each host, decided from what the probe observed (probe/preflight.py): the GPU
set this job gets, the transport, the folders' space, node 0's master port, the master's interface, the image, and
whether a running job of this name is replaced. Each writes its cell of the host's report."""

from __future__ import annotations

import re
from collections.abc import Sequence

from orchestrate.config import Delivery, Program, Resources
from orchestrate.plan import gpus, gpuset, ports, transport
from orchestrate.probe.observations import HostReport


def judge_gpus(facts: dict[str, str], report: HostReport, resources: Resources, slots: int | None) -> None:
    """PURE: GPUs visible (nvidia-smi), and the set this job gets beside the other jobs' (gpuset.py); skipped
    with --gpus 0. Whether containers can use them (the runtime registered with the daemon, the driver new
    enough for the image's CUDA) is the GPU probe's fact, once the image is on the node (gpuprobe.py)."""
    if not resources.gpus:
        report.add("gpus", True, "CPU mode")
        return
    smi = facts.get("smi", "missing")
    if smi == "missing":
        report.add("gpus", False, "nvidia-smi not found (no NVIDIA driver); install it, or use --gpus 0 for CPU")
        return
    if smi != "ok":
        report.add("gpus", False, f"nvidia-smi failed: {' '.join(smi.split())[:120]}")
        return
    count = int(facts.get("gpus") or 0)
    report.gpus = count
    need = max(resources.gpus, slots or 0, 1)
    if count < need:
        report.add("gpus", False, f"{count} GPU(s) visible, {need} needed; lower --gpus or slots=")
        return
    absent = gpus.absent_indices(resources.gpu_ids, facts.get("gpu_list", ""))
    if absent:
        report.add("gpus", False, absent)
        return
    present = report.present = tuple(gpus.gpu_indices(facts.get("gpu_list", "")))
    grant = gpuset.allocate(resources.gpus, resources.gpu_ids, present, report.holdings.others, report.holdings.own_gpus)
    if grant.problem:
        report.add("gpus", False, grant.problem)
        return
    report.gpu_set = grant.gpus
    busy = gpus.busy_warning(resources.gpus, grant.gpus, facts.get("gpu_list", ""), facts.get("compute_apps", ""))
    text = f"GPU {gpus.gpus_text(grant.gpus)} of {count}"
    rest = gpuset.holders_of(present, report.holdings.others)
    report.add("gpus", True, text + (f"; others: {rest}" if rest else "") + (f"; {busy}" if busy else ""),
               warn=bool(busy))


def judge_transport(facts: dict[str, str], report: HostReport, resources: Resources) -> None:
    """PURE: the InfiniBand/RoCE devices NCCL could use here; a forced `--nccl-transport ib` without them fails."""
    if resources.cpu_mode:
        report.add("net", True, "sockets (gloo)")
        return
    rdma = transport.parse_rdma(facts.get("ib_devs", ""), facts.get("rdma_ports", ""))
    report.ib = rdma.usable
    problem = transport.forced_ib_problem(resources.nccl_transport, rdma)
    if problem:
        report.add("net", False, problem)
    elif resources.nccl_transport == "socket":
        report.add("net", True, "sockets (--nccl-transport socket)")
    else:
        report.add("net", True, rdma.describe())


def settle_transport(reports: Sequence[HostReport], resources: Resources) -> None:
    """PURE: with `auto`, one node without IB puts every node on sockets (NCCL needs one network on all ranks):
    the IB nodes' cells say so."""
    if resources.nccl_transport != "auto" or transport.job_transport("auto", [r.ib for r in reports]) != "socket":
        return
    for r in reports:
        if r.ib and "net" in r.checks:
            r.add("net", True, f"sockets ({r.checks['net'].text} idle: not every node has IB)", warn=True)


def judge_disk(facts: dict[str, str], report: HostReport, resources: Resources, dirs: dict[str, str]) -> None:
    """PURE: the data, checkpoint and log dirs belong to no other account, can be created, are writable, and
    (data, checkpoints) have the free space asked for."""
    texts = []
    for kind in ("data", "ckpt", "log"):
        path, base = dirs[kind], facts.get(f"{kind}_base", "?")
        if facts.get(f"{kind}_foreign"):
            report.add("disk", False, f"{kind} dir {path}: {facts[f'{kind}_foreign']} belongs to another account, "
                                      "which could replace what the job reads or writes; choose a dir of your own "
                                      "or have that folder removed")
            return
        if facts.get(f"{kind}_isdir") != "1":
            report.add("disk", False, f"{kind} dir {path} cannot be created: {base} is not a directory; "
                                      "choose another dir")
            return
        if facts.get(f"{kind}_writable") != "1":
            report.add("disk", False, f"{kind} dir {path} not writable ({base}); choose another dir or fix permissions")
            return
        if kind == "log":
            continue
        try:
            free_gb = int(facts.get(f"{kind}_free_kb", "")) / 1024**2
        except ValueError:
            report.add("disk", False, f"cannot read free space under {base} (df failed)")
            return
        if free_gb < resources.min_free_gb:
            report.add("disk", False, f"{kind} dir {path}: {free_gb:.1f} GB free, {resources.min_free_gb:.10g} GB "
                                      "needed; free space or choose another dir")
            return
        texts.append(f"{kind} {free_gb:.0f}G")
    report.add("disk", True, " ".join(texts))


def judge_port(facts: dict[str, str], report: HostReport, port: int | None, replaced: bool = False) -> None:
    """PURE: node 0's master port (ports.py): the one given, or one free there and claimed by no other job's
    label. A given port the job that `--replace` removes first listens on is not taken (its torchrun holds it)."""
    if facts.get("ss_ok") != "1":
        report.add("port", False, "cannot list listening ports (ss from iproute2 missing?)")
        return
    report.listening = ports.listening_ports(facts.get("listening", ""))
    report.port, text = ports.choose(port, report.listening, report.holdings.others, report.holdings.own_port,
                                     replaced)
    report.add("port", report.port is not None, text)


def judge_master(facts: dict[str, str], report: HostReport, rank: int, addr: str, ssh_port: int,
                 iface: str | None) -> None:
    """PURE: the interface carrying the master address, and whether the address answers from this node.

    A node that holds the address uses the interface that has it (`ip route get` would say lo, which
    breaks gloo); the others use the route's device.
    """
    held = facts.get("held", "").split("@")[0]
    match = re.search(r"\bdev (\S+)", facts.get("route", ""))
    report.iface = iface or held or (match.group(1) if match else None)
    src = re.search(r"\bsrc (\S+)", facts.get("route", ""))
    report.addr = addr if held else src.group(1) if src else None
    if held:
        report.add("master", True, f"{addr} is local")
    elif not match:
        report.add("master", False, f"no route to master address {addr}; check --master-addr and the network")
        return
    elif rank != 0 and facts.get("probe") != "1":
        report.add("master", False, f"master address {addr} not reachable from this node (no TCP answer on "
                                    f"port {ssh_port}); check --master-addr and firewalls")
        return
    else:
        report.add("master", True, f"{addr} reachable")
    if report.iface == "lo" and not addr.startswith("127."):
        report.add("iface", False, "interface resolved to lo; set iface= for this host in the hosts file")
    else:
        report.add("iface", True, report.iface or "?")


def judge_image(report: HostReport, delivery: Delivery, program: Program, local_id: str | None) -> None:
    """PURE: the job's image on the node (the probe's `image_id`): present, replaced, pulled, sent, or missing."""
    if report.image_id is not None:
        same = local_id is None or report.image_id == local_id
        report.add("image", True, "present" if same else "present, differs from local: will be replaced")
    elif delivery.pull:
        report.add("image", True, "will be pulled")
    elif local_id is not None:
        report.add("image", True, "will be sent")
    else:
        report.add("image", False, f"{program.image} missing here and on this machine; build it (make image), "
                                   "or pass --pull to pull it on the nodes")


def judge_job(report: HostReport, job: str, replace: bool) -> bool:
    """PURE: whether the job runs here (the caller's containers the probe found) and --replace (the first
    attempt's only) will remove it before the start."""
    running = [c.name for c in report.containers if c.status in ("running", "restarting", "created")]
    if running and not replace:
        report.add("job", False, f"job {job!r} already running here ({', '.join(running)}); "
                                 f"use --replace, or 'kill --job {job}'")
    else:
        report.add("job", True, "replace" if running else "free")
    return bool(running and replace)
