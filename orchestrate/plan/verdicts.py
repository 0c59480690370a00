"""PURE: preflight's verdicts on each host, decided from what the probe observed (Daemons.probe_host): the GPU
cell (from the set plan/gpuset.py decides), the transport, the folders' space, node 0's master port, the master's
interface, the image, and whether a running job of this name is replaced. Each returns its cell (and what it
decided); pipeline/preflight.py puts them into the host's report, once."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrate.config import Delivery, Program, Resources
from orchestrate.plan import ports, transport
from orchestrate.plan.gpuset import GpuSet
from orchestrate.probe.observations import Check, ContainerSeen, Holdings


def judge_gpus(decided: GpuSet) -> Check:
    """PURE: the `gpus` cell, from the GPU set the plan decided (plan/gpuset.py's decide_gpus). Whether containers
    can use the GPUs (the runtime registered with the daemon, the driver new enough for the image's CUDA) is the
    GPU probe's, once the image is on the node (checks/gpuprobe.py)."""
    if decided.refused:
        return Check(False, decided.why)
    return Check(True, decided.why + (f"; {decided.busy}" if decided.busy else ""), warn=bool(decided.busy))


@dataclass(frozen=True)
class Network:
    """The transport's verdict on one node: whether an InfiniBand/RoCE port NCCL can use is there (None: not
    probed), and the `net` cell."""

    ib: bool | None
    check: Check


def judge_transport(facts: Mapping[str, str], resources: Resources) -> Network:
    """PURE: the InfiniBand/RoCE devices NCCL could use here; a forced `--nccl-transport ib` without them fails."""
    if resources.cpu_mode:
        return Network(None, Check(True, "sockets (gloo)"))
    rdma = transport.parse_rdma(facts.get("ib_devs", ""), facts.get("rdma_ports", ""))
    problem = transport.forced_ib_problem(resources.nccl_transport, rdma)
    if problem:
        return Network(rdma.usable, Check(False, problem))
    if resources.nccl_transport == "socket":
        return Network(rdma.usable, Check(True, "sockets (--nccl-transport socket)"))
    return Network(rdma.usable, Check(True, rdma.describe()))


def settle_transport(nets: Sequence[Network], resources: Resources) -> list[Network]:
    """PURE: with `auto`, one node without IB puts every node on sockets (NCCL needs one network on all ranks):
    the IB nodes' cells say so."""
    if resources.nccl_transport != "auto" or transport.job_transport("auto", [n.ib for n in nets]) != "socket":
        return list(nets)
    return [Network(n.ib, Check(True, f"sockets ({n.check.text} idle: not every node has IB)", warn=True))
            if n.ib and n.check.ok else n for n in nets]


def judge_disk(facts: Mapping[str, str], resources: Resources, dirs: Mapping[str, str]) -> Check:
    """PURE: the data, checkpoint and log dirs belong to no other account, can be created, are writable, and
    (data, checkpoints) have the free space asked for."""
    texts = []
    for kind in ("data", "ckpt", "log"):
        path, base = dirs[kind], facts.get(f"{kind}_base", "?")
        if facts.get(f"{kind}_foreign"):
            return Check(False, f"{kind} dir {path}: {facts[f'{kind}_foreign']} belongs to another account, which "
                                "could replace what the job reads or writes; choose a dir of your own or have that "
                                "folder removed")
        if facts.get(f"{kind}_isdir") != "1":
            return Check(False, f"{kind} dir {path} cannot be created: {base} is not a directory; choose another dir")
        if facts.get(f"{kind}_writable") != "1":
            return Check(False, f"{kind} dir {path} not writable ({base}); choose another dir or fix permissions")
        if kind == "log":
            continue
        try:
            free_gb = int(facts.get(f"{kind}_free_kb", "")) / 1024**2
        except ValueError:
            return Check(False, f"cannot read free space under {base} (df failed)")
        if free_gb < resources.min_free_gb:
            return Check(False, f"{kind} dir {path}: {free_gb:.1f} GB free, {resources.min_free_gb:.10g} GB "
                                "needed; free space or choose another dir")
        texts.append(f"{kind} {free_gb:.0f}G")
    return Check(True, " ".join(texts))


@dataclass(frozen=True)
class Port:
    """Node 0's master port: the one given, or one chosen (None: refused), and the `port` cell."""

    port: int | None
    check: Check


def judge_port(facts: Mapping[str, str], holdings: Holdings, port: int | None, replaced: bool = False) -> Port:
    """PURE: node 0's master port (ports.py): the one given, or one free there and claimed by no other job's
    label. A given port the job that `--replace` removes first listens on is not taken (its torchrun holds it)."""
    if facts.get("ss_ok") != "1":
        return Port(None, Check(False, "cannot list listening ports (ss from iproute2 missing?)"))
    chosen, text = ports.choose(port, ports.listening_ports(facts.get("listening", "")), holdings.others,
                                holdings.own_port, replaced)
    return Port(chosen, Check(chosen is not None, text))


@dataclass(frozen=True)
class Master:
    """How a node reaches the master: the interface carrying its address, this node's address toward it (what its
    peers see it connect from), and the `master` and `iface` cells (no `iface` cell when the master is refused)."""

    iface: str | None
    addr: str | None
    checks: tuple[tuple[str, Check], ...]


def judge_master(facts: Mapping[str, str], rank: int, addr: str, ssh_port: int, iface: str | None) -> Master:
    """PURE: the interface carrying the master address, and whether the address answers from this node.

    A node that holds the address uses the interface that has it (`ip route get` would say lo, which
    breaks gloo); the others use the route's device.
    """
    held = facts.get("held", "").split("@")[0]
    match = re.search(r"\bdev (\S+)", facts.get("route", ""))
    chosen = iface or held or (match.group(1) if match else None)
    src = re.search(r"\bsrc (\S+)", facts.get("route", ""))
    seen_from = addr if held else src.group(1) if src else None
    if held:
        master = Check(True, f"{addr} is local")
    elif not match:
        return Master(chosen, seen_from, (("master", Check(False, f"no route to master address {addr}; check "
                                                                  "--master-addr and the network")),))
    elif rank != 0 and facts.get("probe") != "1":
        return Master(chosen, seen_from, (("master", Check(False, f"master address {addr} not reachable from this "
                                                                  f"node (no TCP answer on port {ssh_port}); check "
                                                                  "--master-addr and firewalls")),))
    else:
        master = Check(True, f"{addr} reachable")
    if chosen == "lo" and not addr.startswith("127."):
        return Master(chosen, seen_from, (("master", master), ("iface", Check(
            False, "interface resolved to lo; set iface= for this host in the hosts file"))))
    return Master(chosen, seen_from, (("master", master), ("iface", Check(True, chosen or "?"))))


def judge_image(image_id: str | None, delivery: Delivery, program: Program, local_id: str | None) -> Check:
    """PURE: the job's image on the node (the probe's `image_id`): present, replaced, pulled, sent, or missing."""
    if image_id is not None:
        same = local_id is None or image_id == local_id
        return Check(True, "present" if same else "present, differs from local: will be replaced")
    if delivery.pull:
        return Check(True, "will be pulled")
    if local_id is not None:
        return Check(True, "will be sent")
    return Check(False, f"{program.image} missing here and on this machine; build it (make image), or pass --pull to "
                        "pull it on the nodes")


def judge_job(containers: Sequence[ContainerSeen], job: str, replace: bool) -> tuple[bool, Check]:
    """PURE: whether the job runs here (the caller's containers the probe found) and --replace (the first
    attempt's only) will remove it before the start, and the `job` cell."""
    running = [c.name for c in containers if c.status in ("running", "restarting", "created")]
    if running and not replace:
        return False, Check(False, f"job {job!r} already running here ({', '.join(running)}); use --replace, or "
                                   f"'kill --job {job}'")
    return bool(running), Check(True, "replace" if running else "free")
