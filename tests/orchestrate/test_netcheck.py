"""The network check's pure parts: whom it blames, and the containers it runs."""

from __future__ import annotations

from pathlib import Path

from kit.units import job_specs

from orchestrate.checks.netcheck import (
    FLOOR_GBPS,
    NODE_FLOOR_BY_GPU,
    Floors,
    NodeResult,
    judge,
    outliers,
    planned_transport,
    script,
)
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.shortlived import network_check
from orchestrate.probe.observations import NodeFacts


def head(pairs: dict[tuple[int, int], float]) -> dict:
    return {"rank": 0, "world": 3, "allreduce": [{"mb": 1, "busbw_gbps": 0.5}, {"mb": 2, "busbw_gbps": 0.9}],
            "pairs": [{"a": a, "b": b, "gbps": g} for (a, b), g in pairs.items()]}


def test_the_node_whose_pairs_are_all_slow_is_the_outlier() -> None:
    fast, slow = 2.7, 0.004
    v = judge([NodeResult(0, "a", 0, head({(0, 1): fast, (0, 2): slow, (1, 2): slow})),
               NodeResult(1, "b", 0, {"rank": 1, "ok": True}), NodeResult(2, "c", 0, {"rank": 2, "ok": True})])
    assert v.outliers == [2] and v.allreduce_gbps == 0.9 and v.node_best == {0: fast, 1: fast, 2: slow}
    # Node 0 slow: its pairs are slow, the pair without it is fast.
    assert judge([NodeResult(0, "a", 0, head({(0, 1): slow, (0, 2): slow, (1, 2): fast}))]).outliers == [0]
    # Equal hosts, within noise: nobody.
    assert judge([NodeResult(0, "a", 0, head({(0, 1): 2.6, (0, 2): 3.1, (1, 2): 2.6}))]).outliers == []
    assert outliers({0: 1.0, 1: 0.001}) == []  # two nodes share their only pair: nothing to compare


def test_the_node_that_cannot_reach_the_master_is_blamed_not_the_ones_waiting_for_it() -> None:
    v = judge([NodeResult(0, "a", 3, {"rank": 0, "error": "timed out waiting for 3 clients"}),
               NodeResult(1, "b", 3, {"rank": 1, "error": "cannot reach the master 10.0.0.1:29500 from this node",
                                      "kind": "unreachable"}),
               NodeResult(2, "c", 3, {"rank": 2, "error": "timed out"})])
    assert list(v.cannot_join) == [1] and v.allreduce_gbps is None
    # No typed cause: every node that failed is listed.
    v = judge([NodeResult(0, "a", 137, None), NodeResult(1, "b", 0, {"rank": 1, "ok": True})])
    assert v.cannot_join == {0: "no result (exit code 137)"}


def test_the_check_runs_in_the_jobs_image_with_its_network_settings() -> None:
    hosts = [Host(name=n, hostname=n, port=22, user=None, slots=None) for n in ("a", "b")]
    config = UpConfig.of(ssh=SSHOptions(Path("h"), None, False), job="r18", image="img:1", gpus=0)
    specs = job_specs(config, hosts, "10.0.0.1", [NodeFacts(iface="ib0", addr="10.0.0.1"),
                                                  NodeFacts(iface="ib0", addr="10.0.0.2")])
    checks = network_check(specs, True, 16, script())
    assert [c.name for c in checks] == ["r18-netcheck-node0", "r18-netcheck-node1"]
    assert all(c.image == "img:1" and c.network_mode == "host" and c.mounts == () for c in checks)
    assert checks[1].env["GLOO_SOCKET_IFNAME"] == "ib0" and checks[1].env["MASTER_ADDR"] == "10.0.0.1"
    assert checks[1].env["NODE_RANK"] == "1"  # the program forks the node's processes and ranks them itself
    assert checks[0].command[:2] == ("python3", "-c") and "--pairs" in checks[0].command
    # CPU nodes of one process each: 2 per node all the same, so that something is measured within the node.
    assert checks[0].command[3:7] == ("--procs", "2,2", "--device", "cpu")
    gpu = config.with_options(gpus=8)
    specs = job_specs(gpu, hosts, "10.0.0.1", [NodeFacts(iface="ib0", addr="10.0.0.1", gpus=8)] * 2)
    assert network_check(specs, False, 16, script())[0].command[3:7] == ("--procs", "8,8", "--device", "cuda")
    assert checks[0].labels["ddp-cifar.job"] == "r18-netcheck"


def test_tables_fit_80_and_120_columns() -> None:
    import io

    from rich.console import Console

    from orchestrate.checks.netcheck import render

    v = judge([NodeResult(0, "a", 0, head({(0, 1): 2.7, (0, 2): 0.004, (1, 2): 0.004}))])
    labels = ["gpu-node-with-a-rather-long-name-0.cluster.example.org"] * 3
    for width in (80, 120):
        out = io.StringIO()
        Console(file=out, width=width).print(render(v, labels))
        assert max(len(line) for line in out.getvalue().splitlines()) <= width


IB_LINES = ["NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.10.0.7<0>", "Using network IB",
            "via P2P/CUMEM/read", "via NET/IB/0/GDRDMA", "NVLS multicast support is available on dev 0"]
# A node whose container lacks /dev/infiniband: NCCL's IB plugin finds no device and it falls back to sockets.
SOCKET_LINES = ["NET/Socket : Using [0]eth0:10.1.0.8<0>", "Using network Socket", "via P2P/CUMEM/read",
                "via NET/Socket/0"]


def gpu_node(rank: int, within: float, nccl: list[str], across: float | None = None) -> NodeResult:
    payload = {"rank": rank * 8, "node": rank, "backend": "nccl", "within": [{"mb": 256, "busbw_gbps": within}],
               "nccl": nccl}
    if across is not None:
        payload |= {"allreduce": [{"mb": 256, "busbw_gbps": across}], "pairs": [{"a": 0, "b": 1, "gbps": across}]}
    return NodeResult(rank, f"n{rank}", 0, payload)


def test_ib_planned_but_socket_used_fails_the_node_that_used_it() -> None:
    v = judge([gpu_node(0, 350.0, IB_LINES, across=45.0), gpu_node(1, 350.0, SOCKET_LINES)], planned="ib")
    assert v.problems == {1: ["InfiniBand planned, but NCCL used socket (eth0 10.1.0.8<0>) (is /dev/infiniband "
                              "in the container?)"]}
    assert (v.paths[0].net, v.paths[0].local) == ("IB", ("P2P/CUMEM", "NVLS"))
    assert v.within_gbps == {0: 350.0, 1: 350.0} and v.allreduce_gbps == 45.0
    # Sockets planned (NCCL_IB_DISABLE=1) and IB used is as wrong; one node alone has no network to compare.
    assert 0 in judge([gpu_node(0, 350.0, IB_LINES, across=45.0), gpu_node(1, 350.0, IB_LINES)], "socket").problems
    assert judge([gpu_node(0, 350.0, SOCKET_LINES)], planned="ib").problems == {}


def test_a_floor_makes_two_nodes_fail_and_the_defaults_follow_the_transport() -> None:
    two = [gpu_node(0, 350.0, IB_LINES, across=1.5), gpu_node(1, 1.0, IB_LINES)]
    v = judge(two, planned="ib")  # IB's default floor (2 GB/s) across; NCCL's (2 GB/s) within
    assert v.problems == {0: ["across nodes 1.5 GB/s, below the floor 2.0 GB/s"],
                          1: ["within the node 1.0 GB/s, below the floor 2.0 GB/s",
                              "across nodes 1.5 GB/s, below the floor 2.0 GB/s"]}
    assert judge(two, planned="ib", floors=Floors(across=1.0, within=0.5)).problems == {}
    # Over sockets the default floor is sockets' (0.05 GB/s): the same 1.5 GB/s passes.
    sockets = [gpu_node(0, 350.0, SOCKET_LINES, across=1.5), gpu_node(1, 350.0, SOCKET_LINES)]
    assert judge(sockets, planned="socket").problems == {}
    assert FLOOR_GBPS["gloo"] < FLOOR_GBPS["socket"] < FLOOR_GBPS["ib"]


def test_a_node_without_cuda_is_the_cause_not_the_peers_that_waited_for_it() -> None:
    v = judge([NodeResult(0, "a", 3, {"rank": 0, "error": "Timed out"}),
               NodeResult(1, "b", 3, {"rank": 8, "error": "CUDA is not available in this container; ...",
                                      "kind": "no-cuda"})], planned="ib")
    assert list(v.cannot_join) == [1] and v.cannot_join[1].startswith("CUDA is not available")


def test_the_planned_transport_is_what_the_containers_get() -> None:
    hosts = [Host(name=n, hostname=n, port=22, user=None, slots=None) for n in ("a", "b")]
    config = UpConfig.of(ssh=SSHOptions(Path("h"), None, False), gpus=8)
    for ib, planned in ((True, "ib"), (False, "socket")):
        spec = job_specs(config, hosts, "10.0.0.1", [NodeFacts(iface="eth0", gpus=8, ib=ib)] * 2)[0]
        assert planned_transport(spec, cpu=False) == planned and planned_transport(spec, cpu=True) == "gloo"
    mine = config.with_options(env=(("NCCL_IB_DISABLE", "0"),))  # the user's own --env wins: NCCL decides
    spec = job_specs(mine, hosts, "10.0.0.1", [NodeFacts(iface="eth0", gpus=8, ib=False)] * 2)[0]
    assert planned_transport(spec, cpu=False) == "auto"


def test_infiniband_without_gpudirect_rdma_is_named() -> None:
    """NCCL's channel lines end in /GDRDMA where the NIC reads GPU memory itself (net.cc); without it every
    transfer goes through host memory (nvidia-peermem not loaded): the node that shows it fails, named."""
    staged = [line.replace("/GDRDMA", "") for line in IB_LINES]
    v = judge([gpu_node(0, 350.0, IB_LINES, across=45.0), gpu_node(1, 350.0, staged)], planned="ib")
    assert list(v.problems) == [1]
    assert v.problems[1][0].startswith("NCCL used IB (mlx5_0:1, mlx5_1:1; bootstrap over ib0) without GPUDirect "
                                       "RDMA (no GDRDMA in its NET/IB channel lines)")


def test_the_floor_within_an_nvswitch_node_follows_its_gpu_model() -> None:
    """An H100 SXM node whose NCCL fell back to SHM (~20 GB/s) passed the old 2 GB/s floor; its model's floor
    (150 GB/s) fails it. An H100 PCIe node has no NVSwitch: the transport's floor still applies."""
    sxm = {**gpu_node(0, 20.0, IB_LINES).payload, "gpu": "NVIDIA H100 80GB HBM3"}  # type: ignore[dict-item]
    pcie = {**gpu_node(1, 20.0, IB_LINES).payload, "gpu": "NVIDIA H100 PCIe"}  # type: ignore[dict-item]
    v = judge([NodeResult(0, "n0", 0, sxm), NodeResult(1, "n1", 0, pcie)], planned="ib")
    assert v.problems == {0: ["within the node 20.0 GB/s, below the floor 150.0 GB/s"]}
    assert judge([NodeResult(0, "n0", 0, sxm)], planned="ib", floors=Floors(within=10.0)).problems == {}


def test_the_node_floors_name_the_gpus_of_the_peak_table() -> None:
    """One list of GPU names: trainer/hardware.py's PEAK_TFLOPS (the orchestrator cannot import it: torch)."""
    from trainer.hardware import PEAK_TFLOPS

    peak_names = [name for name, _, _ in PEAK_TFLOPS]
    assert [name for name, _ in NODE_FLOOR_BY_GPU if name != "A100-SXM"] == peak_names
