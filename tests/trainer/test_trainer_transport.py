"""The transport line rank 0 logs at start: NCCL's own INFO lines parsed (unit, in the formats of NVIDIA/nccl's
sources: src/init.cc "Using network %s", net_ib "NET/IB : Using%s %s; OOB %s:%s" with " [%d]%s:%d/%s" per
device, net_socket "NET/Socket : Using%s" with " [%d]%s:%s"), and gloo's line from a real torchrun run.
Only a GPU node makes NCCL write them for real."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit.trainer_helpers import base_args, run_torchrun

from trainer import transport

PREFIX = "node7:1234:1290 [0] NCCL INFO "
IB_LOG = (f"{PREFIX}NCCL_IB_DISABLE set by environment to 0.\n"
          f"{PREFIX}NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.10.0.7<0>\n"
          f"{PREFIX}Using network IB\n")
ROCE_LOG = (f"{PREFIX}NET/IB : Using [0]mlx5_2:1/RoCE ; OOB eth0:192.168.4.2<0>\n"
            f"{PREFIX}Using network IB\n")
SOCKET_LOG = (f"{PREFIX}NET/IB : No device found.\n"
              f"{PREFIX}NET/Socket : Using [0]eth0:10.1.0.5<0> [1]eth1:10.2.0.5<0>\n"
              f"{PREFIX}Using network Socket\n")


@pytest.mark.parametrize(("text", "said"), [
    (IB_LOG, "IB (mlx5_0:1, mlx5_1:1; bootstrap over ib0)"),
    (ROCE_LOG, "RoCE (mlx5_2:1; bootstrap over eth0)"),
    (SOCKET_LOG, "socket (eth0 10.1.0.5<0>, eth1 10.2.0.5<0>)"),
    (f"{PREFIX}Using network AWS Libfabric\n", "AWS Libfabric"),  # an external plugin: its name as NCCL gives it
    ("", None),
])
def test_nccls_lines_name_the_transport_and_device(text: str, said: str | None) -> None:
    assert transport.describe_nccl(text) == said


def test_rank_0_asks_nccl_for_its_init_and_net_lines_in_the_log_dir(tmp_path: Path) -> None:
    assert transport.nccl_debug_env({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "COLL"}, tmp_path) == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL,INIT,NET",
        "NCCL_DEBUG_FILE": str(tmp_path / transport.NCCL_LOG_NAME)}
    assert transport.nccl_debug_env({"NCCL_DEBUG_FILE": "/mine.%h.%p"}, tmp_path) == {}  # the user's own


def test_gloo_says_its_interface_once(data_dir: Path, tmp_path: Path) -> None:
    res = run_torchrun(2, base_args(data_dir, tmp_path, "--epochs", "1", "--max-steps", "1", "--batch-size", "16"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [ln.split("INFO ")[1] for ln in res.stderr.splitlines() if "transport:" in ln] == ["transport: gloo over lo"]


# Two 8-GPU nodes, as NCCL writes the lines (debug.cc's "host:pid:tid [dev] NCCL INFO " and the formats of
# p2p.cc, shm.cc, net.cc, nvls.cc, init.cc); written by hand from those sources, no GPU node here.
NODE_LOG = f"""{PREFIX}NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.10.0.7<0>
{PREFIX}Using network IB
{PREFIX}NVLS multicast support is available on dev 0
{PREFIX}Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
{PREFIX}Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
{PREFIX}Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
{PREFIX}Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/1(0)/GDRDMA
{PREFIX}Channel 02 : 0[0] -> 2[2] via SHM/direct/direct
{PREFIX}Channel 03/0 : 0[0] -> 3[3] via P2P/indirect/2[2]
{PREFIX}comm 0x55d0 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
"""
FALLBACK_LOG = f"""{PREFIX}NET/IB : No device found.
{PREFIX}NET/Socket : Using [0]eth0:10.1.0.5<0>
{PREFIX}Using network Socket
{PREFIX}NVLS multicast support is not available on dev 0
{PREFIX}Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
{PREFIX}Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_the_network_checks_nccl_lines_say_what_carried_the_traffic() -> None:
    from trainer.bandwidth import nccl_says

    said = nccl_says(NODE_LOG)
    assert said == ["NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.10.0.7<0>", "Using network IB",
                    "NVLS multicast support is available on dev 0", "via P2P/CUMEM/read", "via NET/IB/0/GDRDMA",
                    "via NET/IB/1(0)/GDRDMA", "via SHM/direct/direct", "via P2P/indirect/2[2]"]
    assert transport.nccl_paths(said) == transport.NcclPaths(
        "IB", ("P2P/CUMEM", "SHM", "P2P/indirect", "NVLS"), "IB (mlx5_0:1, mlx5_1:1; bootstrap over ib0)",
        gdrdma=True)
    assert transport.nccl_paths(nccl_says(FALLBACK_LOG)) == transport.NcclPaths(
        "Socket", ("P2P/IPC",), "socket (eth0 10.1.0.5<0>)")
    assert transport.nccl_paths([]) == transport.NcclPaths(None, (), None)
