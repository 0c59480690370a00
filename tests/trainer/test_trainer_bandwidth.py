"""The network check's program (trainer/bandwidth.py) for real on this machine: two "nodes" of two processes each
on loopback, as `check` starts it (`python3 -c SCRIPT`, NODE_RANK and the master from the environment), gloo.
Its lines go through the orchestrator's own judge: the default floor for gloo passes, a floor above what gloo
gets fails both nodes. A GPU check where CUDA is missing says so in one line and measures nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from kit.net import free_port
from kit.trainer_helpers import REPO, child_env

from orchestrate.checks.netcheck import MARK, Floors, NodeResult, judge, script


def start(node: int, port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script(), "--max-mb", "2", "--timeout", "30", *args],
                            cwd=REPO, env={**child_env(), "NODE_RANK": str(node), "MASTER_PORT": str(port), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines(proc: subprocess.Popen[str]) -> tuple[int, list[dict]]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, [json.loads(ln[len(MARK):]) for ln in out.splitlines() if ln.startswith(MARK)]


def test_two_nodes_of_two_processes_measure_within_and_across_and_a_floor_can_fail_them() -> None:
    port = free_port()
    procs = [start(node, port, "--procs", "2,2", "--device", "cpu", "--pairs") for node in (0, 1)]
    (rc0, head), (rc1, other) = lines(procs[0]), lines(procs[1])
    assert (rc0, rc1) == (0, 0), (head, other)
    assert len(head) == 1 and len(other) == 1  # one line per node: its first process's
    assert head[0]["rank"] == 0 and other[0]["rank"] == 2 and head[0]["backend"] == "gloo"
    assert head[0]["within"] and other[0]["within"] and head[0]["allreduce"] and "allreduce" not in other[0]
    results = [NodeResult(0, "a", rc0, head[0]), NodeResult(1, "b", rc1, other[0])]
    v = judge(results, planned="gloo")
    assert v.problems == {} and v.cannot_join == {} and set(v.within_gbps) == {0, 1} and v.node_best
    high = judge(results, planned="gloo", floors=Floors(across=1000.0, within=1000.0))
    assert sorted(high.problems) == [0, 1]
    assert high.problems[1][0].startswith("within the node") and "below the floor 1000.0 GB/s" in high.problems[1][0]
    assert high.problems[1][1].startswith("across nodes")


def test_a_gpu_check_without_cuda_fails_in_one_line_and_never_measures_gloo() -> None:
    rc, said = lines(start(0, free_port(), "--procs", "1", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""}))
    assert rc == 3 and len(said) == 1, said
    assert said[0]["kind"] == "no-cuda" and said[0]["error"].startswith("CUDA is not available in this container")
    assert "within" not in said[0] and "allreduce" not in said[0]
