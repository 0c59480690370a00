"""Network check program: all_reduce bus bandwidth over all ranks, then ping-pong bandwidth of every node pair.

Run by `python -m orchestrate check` (and `up --check-network`) as one process per node, with the job's
image and network settings: `python3 -c "<this file>" --max-mb M` and the usual RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Self-contained (stdlib + torch) so it runs in
any image with torch. Prints one line `NETCHECK {json}` from every rank: rank 0's holds the figures; a rank that
cannot join says why (`{"error": ...}`) and exits 3.

Bus bandwidth as nccl-tests define it: algbw = bytes / time; all_reduce busbw = algbw * 2(n-1)/n, the traffic
each link carries, comparable across world sizes. A pair's figure: bytes / (round trip / 2).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MB = 1 << 20
BUDGET_S = 0.5  # per measurement: sizes double from 1 MB until one transfer takes this long or --max-mb


def _say(payload: dict[str, object]) -> None:
    print("NETCHECK " + json.dumps(payload), flush=True)


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


def allreduce_busbw(world: int, device: torch.device, max_mb: int) -> list[dict[str, float]]:
    out = []
    for mb in _sizes(max_mb):
        t = torch.ones(mb * MB // 4, dtype=torch.float32, device=device)
        took = _timed(functools.partial(_all_reduce_synced, t, device), reps=3)
        # Every rank decides the same way: the slowest rank's time (a MAX all_reduce), so no rank leaves early.
        took = _agree_max(took, device)
        out.append({"mb": mb, "busbw_gbps": mb * MB / took * 2 * (world - 1) / world / 1e9, "s": took})
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


def _all_reduce_synced(t: torch.Tensor, device: torch.device) -> None:
    dist.all_reduce(t)
    _sync(device)  # a GPU all_reduce returns once queued: time it to its end


def _agree_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


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


def main() -> int:
    p = argparse.ArgumentParser(prog="bandwidth")
    p.add_argument("--max-mb", type=int, default=256)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--pairs", action="store_true", help="also every node pair (ping-pong)")
    ns = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and os.environ.get("NETCHECK_DEVICE", "auto") != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if rank != 0 and not _reaches_master(ns.timeout):
        _say({"rank": rank, "error": f"cannot reach the master {os.environ['MASTER_ADDR']}:"
                                     f"{os.environ['MASTER_PORT']} from this node", "kind": "unreachable"})
        return 3
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=ns.timeout))
    except Exception as err:  # cannot reach the master, or a peer never came
        _say({"rank": rank, "error": " ".join(str(err).split())[:300]})
        return 3
    try:
        result: dict[str, object] = {"rank": rank, "world": world, "backend": dist.get_backend(),
                                     "allreduce": allreduce_busbw(world, device, ns.max_mb)}
        if ns.pairs:
            result["pairs"] = [{"a": a, "b": b, "gbps": pair_bw(a, b, rank, device, ns.max_mb)}
                               for a in range(world) for b in range(a + 1, world)]
        _say(result if rank == 0 else {"rank": rank, "ok": True})
        return 0
    except Exception as err:  # a peer lost mid-way
        _say({"rank": rank, "error": " ".join(str(err).split())[:300]})
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
