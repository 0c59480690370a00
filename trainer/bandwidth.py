"""Network check program: all_reduce bus bandwidth within each node and across all nodes, one process per GPU,
then ping-pong bandwidth of every node pair; the lines in which NCCL says which transports it used.

Run by `python -m orchestrate check` (and `up --check-network`) as one container per node, with the job's image,
network settings and rendezvous address: `python3 -c "<this file>" --procs 8,8 --device cuda --max-mb M` and the
job's NODE_RANK, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Self-contained (stdlib +
torch), so it runs in any image with torch. It forks this node's processes itself (--procs holds every node's
count, so each process knows its global rank); no launcher is needed. Every process then:
1. within its node: all_reduce among the node's own processes (NCCL: NVLink, P2P or SHM; gloo: loopback), every
   node at once, each in its own group;
2. across nodes: all_reduce over every process of every node (each GPU's traffic crosses the network as in DDP);
3. with --pairs: ping-pong between the first processes of every two nodes.
--device cuda without CUDA is an error, never a quiet gloo run. On NCCL every process asks NCCL for its INIT and
NET lines in a file of its own; the node's first process returns those that name a transport.

Prints `NETCHECK {json}`: each node's first process one line (global rank 0's also holds the across-node figures
and the pairs); a process that fails says why (`{"error": ...}`) and exits 3.

Bus bandwidth as nccl-tests define it: algbw = bytes / time; all_reduce busbw = algbw * 2(n-1)/n, the traffic
each link carries, comparable across world sizes. A pair's figure: bytes / (round trip / 2).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MB = 1 << 20
BUDGET_S = 0.5  # per measurement: sizes double from 1 MB until one transfer takes this long or --max-mb
# NCCL's INFO lines that name a transport (formats from NVIDIA/nccl's sources: init.cc "Using network %s",
# net_ib "NET/IB : Using...", net_socket "NET/Socket : Using...", nvls.cc "NVLS multicast support is
# available...", and the channel lines of p2p.cc, shm.cc, net.cc: "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC").
_SAYS = re.compile(r"NCCL INFO (?:Channel [^:]*: \S+ -> \S+ (?:\[\w+\] )?)?((?:via |Using network |NET/IB : Using|"
                   r"NET/Socket : Using|NVLS multicast support is available).*)$")


def _say(payload: dict[str, object]) -> None:
    sys.stdout.write("NETCHECK " + json.dumps(payload) + "\n")  # one write: the node's processes share the stream
    sys.stdout.flush()


def _timed(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: connections, buffers
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _sizes(max_mb: int) -> list[int]:
    sizes, mb = [], 1
    while mb <= max_mb:
        sizes.append(mb)
        mb *= 2
    return sizes


def allreduce_busbw(device: torch.device, max_mb: int, group: dist.ProcessGroup | None = None) -> list[dict[str, float]]:
    """Bus bandwidth of an all_reduce over `group` (None: every process) at doubling sizes."""
    n = dist.get_world_size(group)
    out = []
    for mb in _sizes(max_mb):
        t = torch.ones(mb * MB // 4, dtype=torch.float32, device=device)
        took = _timed(functools.partial(_all_reduce_synced, t, device, group), reps=3)
        # Every rank decides the same way: the slowest rank's time (a MAX all_reduce), so no rank leaves early.
        took = _agree_max(took, device, group)
        out.append({"mb": mb, "busbw_gbps": mb * MB / took * 2 * (n - 1) / n / 1e9, "s": took})
        if took > BUDGET_S:
            break
    return out


def pair_bw(a: int, b: int, rank: int, device: torch.device, max_mb: int) -> float:
    """Ping-pong between ranks a and b (the others wait at the barrier); bytes per second one way (GB/s)."""
    best = 0.0
    for mb in _sizes(max_mb):
        t = torch.ones(mb * MB // 4, dtype=torch.float32, device=device)
        took = 0.0
        if rank in (a, b):
            peer = b if rank == a else a

            def ping_pong(t: torch.Tensor = t, peer: int = peer) -> None:
                if rank == a:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
                _sync(device)

            took = _timed(ping_pong, reps=2) / 2
            best = max(best, mb * MB / took / 1e9)
        took = _agree_max(took, device)
        if took > BUDGET_S:
            break
    return _agree_max(best, device)  # rank 0 reports every pair, its own or not


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce_synced(t: torch.Tensor, device: torch.device, group: dist.ProcessGroup | None) -> None:
    dist.all_reduce(t, group=group)
    _sync(device)  # a GPU all_reduce returns once queued: time it to its end


def _agree_max(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def nccl_says(text: str) -> list[str]:
    """The distinct transport statements of NCCL's log, without the channel and rank numbers (a channel line
    `... Channel 03/0 : 1[1] -> 0[0] via P2P/CUMEM/read` becomes `via P2P/CUMEM/read`)."""
    found = (_SAYS.search(line) for line in text.splitlines())
    return list(dict.fromkeys(m.group(1).strip() for m in found if m))


def _reaches_master(timeout: float) -> bool:
    """A TCP connection to the rendezvous port (rank 0 may not listen yet: tried again until `timeout`), so a
    node that cannot reach the master says so instead of waiting out the process group's timeout."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def _device(kind: str, local: int) -> torch.device:
    """This process's device; a GPU check without CUDA (or with fewer GPUs than processes) is an error."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LookupError("CUDA is not available in this container; a GPU job's check measures NCCL, never gloo "
                          "(is the NVIDIA container runtime installed, and did the GPU probe pass?)")
    if local >= torch.cuda.device_count():
        raise LookupError(f"process {local} of this node needs GPU {local}, but {torch.cuda.device_count()} "
                          "are visible in the container")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _log_path(parent: int, local: int | str) -> str:
    return os.path.join(tempfile.gettempdir(), f"netcheck-{parent}-nccl-{local}.log")


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _measure(ns: argparse.Namespace, procs: list[int], node: int, local: int, device: torch.device,
             parent: int) -> dict[str, object]:
    """Steps 1-3 (collective: every process of every node); this node's line, or {} for a non-first process."""
    first = [sum(procs[:n]) for n in range(len(procs))]  # global rank of each node's first process
    rank = first[node] + local
    result: dict[str, object] = {"rank": rank, "node": node, "procs": procs[node], "backend": dist.get_backend()}
    within = None
    if max(procs) > 1:  # every process creates every group, in the same order (torch's rule for new_group)
        mine, _ = dist.new_subgroups_by_enumeration([list(range(f, f + n)) for f, n in zip(first, procs, strict=True)])
        within = allreduce_busbw(device, ns.max_mb, mine) if procs[node] > 1 else None
        _agree_max(0.0, device)  # every node done before the all-node measurement starts
    result["within"] = within
    if len(procs) > 1:
        result["allreduce"] = allreduce_busbw(device, ns.max_mb)
    if ns.pairs:
        result["pairs"] = [{"a": a, "b": b, "gbps": pair_bw(first[a], first[b], rank, device, ns.max_mb)}
                           for a in range(len(procs)) for b in range(a + 1, len(procs))]
    _agree_max(0.0, device)  # every process's NCCL log is complete: the node's first process reads them all
    if local != 0:
        return {}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)  # the floor within the node follows the model
        result["nccl"] = nccl_says("".join(_read(path) for path in sorted(glob.glob(_log_path(parent, "*")))))
    if rank != 0:  # the across-node figures are rank 0's to give
        result.pop("allreduce", None)
        result.pop("pairs", None)
    return result


def _process(ns: argparse.Namespace, procs: list[int], node: int, local: int, parent: int) -> int:
    """One forked process: join, measure, say; its exit code."""
    rank = sum(procs[:node]) + local
    try:
        device = _device(ns.device, local)
    except LookupError as err:
        _say({"rank": rank, "node": node, "error": str(err), "kind": "no-cuda"})
        return 3
    if device.type == "cuda":  # NCCL reads these once, when it starts
        os.environ.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                           "NCCL_DEBUG_FILE": _log_path(parent, local)})
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=sum(procs),
                                timeout=datetime.timedelta(seconds=ns.timeout),
                                device_id=device if device.type == "cuda" else None)
    except Exception as err:  # cannot reach the master, or a peer never came
        _say({"rank": rank, "node": node, "error": " ".join(str(err).split())[:300]})
        return 3
    try:  # no destroy_process_group: the process ends without finalizing once it has said its line (_fork_all)
        line = _measure(ns, procs, node, local, device, parent)
        if line:
            _say(line)
        return 0
    except Exception as err:  # a peer lost mid-way
        _say({"rank": rank, "node": node, "error": " ".join(str(err).split())[:300]})
        return 3


def _fork_all(ns: argparse.Namespace, procs: list[int], node: int) -> int:
    """This node's processes, forked before any of them touches CUDA or starts a thread; the worst exit code."""
    parent, children = os.getpid(), []
    for local in range(procs[node]):
        pid = os.fork()
        if pid == 0:
            code = _process(ns, procs, node, local, parent)
            sys.stdout.flush()
            os._exit(code)  # no teardown: a gloo group's can hang once a peer is gone, its threads abort a finalizer
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    return max((abs(c) for c in codes), default=0)


def main() -> int:
    p = argparse.ArgumentParser(prog="bandwidth", allow_abbrev=False)
    p.add_argument("--procs", default="1", help="processes of every node, comma-separated (node 0's first)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    p.add_argument("--max-mb", type=int, default=256)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--pairs", action="store_true", help="also every node pair (ping-pong)")
    ns = p.parse_args()
    procs, node = [int(n) for n in ns.procs.split(",")], int(os.environ.get("NODE_RANK", "0"))
    if node != 0 and not _reaches_master(ns.timeout):
        _say({"rank": sum(procs[:node]), "node": node, "error": f"cannot reach the master {os.environ['MASTER_ADDR']}:"
                                                              f"{os.environ['MASTER_PORT']} from this node",
              "kind": "unreachable"})
        return 3
    return _fork_all(ns, procs, node)


if __name__ == "__main__":
    sys.exit(main())
