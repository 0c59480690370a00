"""NCCL's network between the nodes: InfiniBand/RoCE where every node has it, else sockets. PURE, no I/O.

Preflight's probe lists /dev/infiniband (the verbs devices user space opens) and the RDMA ports of
/sys/class/infiniband (kernel ABI: ports/N/state reads `4: ACTIVE`, ports/N/link_layer `InfiniBand` or
`Ethernet`, the latter being RoCE). A container reaches the fabric only with the device folder and IPC_LOCK
(verbs pin their buffers), as `docker run --device=/dev/infiniband --cap-add=IPC_LOCK`; without them NCCL falls
back to sockets on the route to the master without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IB_DEVICE_DIR = "/dev/infiniband"  # Docker adds every device node under a folder given to --device
IB_CAPS = ("IPC_LOCK",)
# NCCL's documented switch (docs.nvidia.com/deeplearning/nccl, env: NCCL_IB_DISABLE=1 disables the IB/RoCE
# transport, NCCL then uses IP sockets).
SOCKET_ENV = {"NCCL_IB_DISABLE": "1"}


@dataclass(frozen=True)
class RdmaFacts:
    """A host's RDMA devices as the probe saw them."""

    verbs: tuple[str, ...]  # uverbsN nodes under /dev/infiniband
    active: tuple[str, ...]  # "mlx5_0/1 IB" / "mlx5_2/1 RoCE": ports in state ACTIVE

    @property
    def usable(self) -> bool:
        return bool(self.verbs and self.active)

    def describe(self) -> str:
        if self.usable:
            kinds = sorted({port.split()[-1] for port in self.active})
            return f"{'/'.join(kinds)} {self.active[0].split('/')[0]}" + (
                f" +{len(self.active) - 1}" if len(self.active) > 1 else "")
        if self.verbs:
            return "sockets (RDMA device, no active port)"
        return "sockets"


def parse_rdma(devices: str, ports: str) -> RdmaFacts:
    """PURE: the probe's `ib_devs` (names under /dev/infiniband, space separated) and `rdma_ports` (one line a
    port: `DEVICE/PORT LINK_LAYER STATE`, e.g. `mlx5_0/1 InfiniBand 4: ACTIVE`)."""
    verbs = tuple(sorted(name for name in devices.split() if name.startswith("uverbs")))
    active = []
    for line in ports.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[2].split(":")[-1].strip() == "ACTIVE":
            active.append(f"{parts[0]} {'RoCE' if parts[1] == 'Ethernet' else 'IB'}")
    return RdmaFacts(verbs, tuple(active))


def forced_ib_problem(choice: str, rdma: RdmaFacts) -> str | None:
    """PURE: why `--nccl-transport ib` cannot run on this host (None: it can, or IB was not forced)."""
    if choice != "ib" or rdma.usable:
        return None
    what = "no active RDMA port" if rdma.verbs else f"no InfiniBand/RoCE device ({IB_DEVICE_DIR} has no uverbs*)"
    return f"--nccl-transport ib, but {what} here; use --nccl-transport auto or socket"


def job_transport(choice: str, usable: Sequence[bool | None]) -> str:
    """PURE: the transport of the whole job. NCCL needs one network on every rank, so `auto` means IB only when
    every node has it, sockets when any lacks it, and stays `auto` (NCCL decides, nothing added) when the nodes
    were not probed (an offline dry run)."""
    if choice != "auto":
        return choice
    if any(u is None for u in usable):
        return "auto"
    return "ib" if all(usable) else "socket"
