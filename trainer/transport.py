"""Which network transport the collectives use, said once at start by global rank 0.

NCCL decides by itself (InfiniBand or RoCE through its IB transport, else TCP sockets) and says so only in its
INFO log, so rank 0 asks for that log, for the INIT and NET subsystems only, in a file of the log dir, and reads
two of NCCL's lines back once the communicator is up (their formats, from NVIDIA/nccl's sources):
- ``src/init.cc``: ``INFO(NCCL_INIT, "Using network %s", ...)``: the network plugin chosen (IB, Socket, or an
  external plugin's name such as IBext_v8);
- ``src/transport/net_ib.cc``: ``"NET/IB : Using%s %s; OOB %s:%s"``, each device as ``" [%d]%s:%d/%s"``
  (index, device, port, IB or RoCE); ``src/transport/net_socket.cc``: ``"NET/Socket : Using%s"``, each
  interface as ``" [%d]%s:%s"`` (index, name, address).
NCCL then writes rank 0's warnings into that file too (NCCL_DEBUG_FILE takes all of its output): the log line
names the file. A user's own NCCL_DEBUG_FILE is left alone (and the transport is then not read).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NCCL_LOG_NAME = "nccl-rank0.log"
_NETWORK = re.compile(r"NCCL INFO Using network (.+)")
_IB = re.compile(r"NET/IB : Using(.*?); OOB (\S+?):")
_IB_DEVICE = re.compile(r"\[\d+\](\S+?):(\d+)/(IB|RoCE)")
_SOCKET = re.compile(r"NET/Socket : Using(.*)")
_INTERFACE = re.compile(r"\[\d+\]([^:\s]+):(\S+)")


def describe_nccl(text: str) -> str | None:
    """PURE: the transport as NCCL's INFO lines state it, e.g. `IB (mlx5_0:1, mlx5_1:1; bootstrap over ib0)`,
    `RoCE (mlx5_0:1; bootstrap over eth0)`, `socket (eth0 10.1.0.5<0>)`; None when NCCL said nothing."""
    network = _NETWORK.search(text)
    ib, socket = _IB.search(text), _SOCKET.search(text)
    name = network.group(1).strip() if network else ("IB" if ib else "Socket" if socket else None)
    if name is None:
        return None
    if name.startswith("IB") and ib:
        devices = _IB_DEVICE.findall(ib.group(1))
        kinds = sorted({kind for _, _, kind in devices}) or ["IB"]
        listed = ", ".join(f"{dev}:{port}" for dev, port, _ in devices)
        return f"{'/'.join(kinds)} ({listed}; bootstrap over {ib.group(2)})"
    if name == "Socket" and socket:
        found = _INTERFACE.findall(socket.group(1))
        return "socket (" + ", ".join(f"{iface} {addr}" for iface, addr in found) + ")"
    return name if name != "Socket" else "socket"


def describe_gloo(env: dict[str, str]) -> str:
    """PURE: gloo uses TCP on GLOO_SOCKET_IFNAME, or on the interface that this host's name resolves to."""
    iface = env.get("GLOO_SOCKET_IFNAME")
    return f"gloo over {iface}" if iface else "gloo over the interface of this host's name (GLOO_SOCKET_IFNAME unset)"


def nccl_debug_env(env: dict[str, str], log_dir: Path) -> dict[str, str]:
    """PURE: what rank 0 sets before NCCL starts so that it writes the two lines; nothing when the user already
    sends NCCL's log to a file of their own."""
    if env.get("NCCL_DEBUG_FILE"):
        return {}
    subsystems = env.get("NCCL_DEBUG_SUBSYS", "")
    wanted = ",".join(dict.fromkeys([s for s in subsystems.split(",") if s] + ["INIT", "NET"]))
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": wanted, "NCCL_DEBUG_FILE": str(log_dir / NCCL_LOG_NAME)}


def before_nccl(log_dir: Path) -> Path | None:
    """Set NCCL's log variables in this process (rank 0, before the communicator); the file to read later."""
    extra = nccl_debug_env(dict(os.environ), log_dir)
    os.environ.update(extra)
    return Path(extra["NCCL_DEBUG_FILE"]) if extra else None


def report_nccl(nccl_log: Path | None) -> None:
    if nccl_log is None:
        log.info("transport: not read (NCCL_DEBUG_FILE is set: NCCL's own log there says it)")
        return
    try:
        text = nccl_log.read_text(errors="replace")
    except OSError:
        text = ""
    found = describe_nccl(text)
    log.info("transport: NCCL %s (NCCL's INFO and warnings of rank 0: %s)", found or "did not say", nccl_log)


@dataclass(frozen=True)
class NcclPaths:
    """What NCCL connected over, from its INFO statements (the network check's `nccl_says` lines)."""

    net: str | None  # the network between nodes: IB, Socket, or an external plugin's name; None: no NET connection
    local: tuple[str, ...]  # within a node: P2P/CUMEM, P2P/IPC, P2P/MNNVL, P2P/direct, P2P/indirect, SHM, NVLS
    said: str | None  # describe_nccl's text of the network (devices, interfaces)
    gdrdma: bool = False  # a NET channel line ends in /GDRDMA: the NIC reads and writes GPU memory directly


# Channel lines, as p2p.cc, shm.cc and net.cc write them after "via ": "P2P/IPC/read", "P2P/CUMEM/CE",
# "P2P/direct pointer", "P2P/indirect/2[2]", "SHM/direct/direct", "NET/IB/0/GDRDMA", "NET/Socket/1".
_VIA_NET = re.compile(r"via NET/([^/]+)/")
_VIA_LOCAL = re.compile(r"via (P2P/(?:direct|indirect|[A-Z]+)|SHM)")
_NVLS = "NVLS multicast support is available"


def nccl_paths(lines: list[str]) -> NcclPaths:
    """PURE: the transports named in NCCL's statements (bandwidth.nccl_says: each line from "via ...",
    "Using network ...", "NET/IB : Using ...", "NET/Socket : Using ..." or "NVLS multicast support is available")."""
    nets = [m.group(1) for m in map(_VIA_NET.match, lines) if m]
    local = [m.group(1) for m in map(_VIA_LOCAL.match, lines) if m] + (["NVLS"] if any(_NVLS in ln for ln in lines) else [])
    said = describe_nccl("".join(f"NCCL INFO {line}\n" for line in lines))
    # net.cc's channel line: "via NET/%s/%d%s%s" with "/GDRDMA" where GPUDirect RDMA is used (useGdr).
    gdrdma = any(line.startswith("via NET/") and "/GDRDMA" in line for line in lines)
    return NcclPaths(nets[0] if nets else None, tuple(dict.fromkeys(local)), said, gdrdma)
