"""`check` as a first-day self-test on the stock test hosts (no GPU): everything but the GPU probe runs for real
(a training step and a checkpoint in the image on each host, the network check), and the GPU probe of a GPU job
really runs against each host's dockerd and names what is missing there, one line per host."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from orchestrate_kit import IMAGE, PATIENCE, REPO, job_containers, orch_env, orchestrate

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def checked(target: Cluster, work, hosts) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """One `check` for the module (it also sends the image to hosts that lack it)."""
    res = orchestrate(target, work / "state", "check", "--hosts", str(hosts), "--gpus", "0", "--image", IMAGE,
                      "--max-mb", "4", "--job", "selftest", "--model", "tiny", timeout=PATIENCE)
    return res.returncode, res.stdout + res.stderr


def test_check_prints_one_row_per_node_with_every_part_passed(target: Cluster, checked: tuple[int, str]) -> None:
    rc, out = checked
    assert rc == 0, out
    table = out[out.index("self-test"):]  # below the preflight and network tables
    for rank, host in enumerate(target.hosts):
        row = next((ln for ln in table.splitlines() if re.match(rf"\W*{rank}\W+{re.escape(host.name)}\W", ln)), None)
        assert row is not None, f"no row for node {rank} ({host.name}):\n{out}"
        assert "CPU mode" in row and "bf16 on cpu: 3 steps" in row, row
        assert "saved, loaded, equal" in row and "best pair" in row, row
    assert job_containers(target, "selftest-selftest") == [] and job_containers(target, "selftest-netcheck") == []


def test_the_gpu_probe_runs_on_each_host_and_names_what_is_missing(target: Cluster, work, hosts,  # type: ignore[no-untyped-def]
                                                                    checked: tuple[int, str]) -> None:
    """Only a GPU host could show a pass; here each host's dockerd refuses the GPU request, as a node without
    the NVIDIA Container Toolkit does."""
    res = subprocess.run([sys.executable, str(REPO / "tests" / "cluster" / "gpu_probe_on_hosts.py"), str(hosts), IMAGE],
                         env=orch_env(target, work / "state"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    results = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["label"].split(":")[0] for r in results] == [h.name for h in target.hosts], res.stdout
    for r in results:
        assert r["problem"].startswith("no NVIDIA container runtime is registered with this host's Docker daemon"), r
        assert "\n" not in r["problem"]
    assert job_containers(target, "gpuprobe-test-gpuprobe") == []
