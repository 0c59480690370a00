"""The network check's pure parts: whom it blames, and the containers it runs."""

from __future__ import annotations

from pathlib import Path

from orchestrate.checks.netcheck import NodeResult, check_specs, judge, outliers
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import NodeFacts, build_plan


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
    config = UpConfig(ssh=SSHOptions(Path("h"), None, False), job="r18", image="img:1", gpus=0)
    specs = build_plan(config, hosts, "10.0.0.1", [NodeFacts(iface="ib0", addr="10.0.0.1"),
                                                  NodeFacts(iface="ib0", addr="10.0.0.2")])
    checks = check_specs(specs, 16)
    assert [c.name for c in checks] == ["r18-netcheck-node0", "r18-netcheck-node1"]
    assert all(c.image == "img:1" and c.network_mode == "host" and c.mounts == () for c in checks)
    assert checks[1].env["GLOO_SOCKET_IFNAME"] == "ib0" and checks[1].env["MASTER_ADDR"] == "10.0.0.1"
    assert (checks[1].env["RANK"], checks[1].env["WORLD_SIZE"]) == ("1", "2")
    assert checks[0].command[:2] == ("python3", "-c") and "--pairs" in checks[0].command
    assert checks[0].labels["ddp-cifar.job"] == "r18-netcheck"


def test_tables_fit_80_and_120_columns_and_long_paths_keep_their_tail() -> None:
    import io

    from rich.console import Console

    from orchestrate.checks.netcheck import render
    from orchestrate.jobs.control import keep_tail

    v = judge([NodeResult(0, "a", 0, head({(0, 1): 2.7, (0, 2): 0.004, (1, 2): 0.004}))])
    labels = ["gpu-node-with-a-rather-long-name-0.cluster.example.org"] * 3
    for width in (80, 120):
        out = io.StringIO()
        Console(file=out, width=width).print(render(v, labels))
        assert max(len(line) for line in out.getvalue().splitlines()) <= width
    path = "/home/alice/.local/share/ddp-cifar/jobs/resnet18-bf16-run3/checkpoints/ckpt-00000240.pt"
    assert keep_tail(path, 40) == "…" + path[-39:] and keep_tail(path, 40).endswith("ckpt-00000240.pt")
    assert keep_tail("short", 40) == "short"
