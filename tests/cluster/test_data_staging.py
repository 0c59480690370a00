"""`up --data-from DIR` on two real test hosts: the first up moves every file, one changed file moves alone (bytes
asserted), then an unchanged folder moves nothing to one node while a file corrupted on the other is found and
replaced there.
The program is examples/charlm, which reads its text from DATA_DIR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kit.orchestrate_kit import example_image, up

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

# A data folder of this module's own: the session's hosts are shared by every module a worker runs, in any order,
# and another module's files in the default folder would count as already sent (CI: "1 of 2 files changed").
DATA_DIR = "/home/ddp/staging-test-data"
ARGS = ["--steps", "3", "--step-seconds", "0", "--ckpt-every", "1000", "--text", "input.txt", "--context", "4"]


@pytest.fixture(scope="module")
def hosts(cluster: Cluster, work: Path) -> Path:
    return cluster.write_hosts_file(work / "hosts.txt", keys={h.index: {"data_dir": DATA_DIR} for h in cluster.hosts})


def stage(cluster: Cluster, work: Path, hosts: Path, src: Path) -> str:
    res = up(cluster, work, hosts, "stage", example_image("charlm"), "-m charlm.train", "--data-from", str(src),
             args=ARGS)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_folder_is_synced_incrementally_and_corruption_on_a_node_is_repaired(
        cluster: Cluster, work: Path, hosts: Path) -> None:
    src = work / "text"
    src.mkdir()
    (src / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    (src / "extra.bin").write_bytes(os.urandom(300_000))
    h0, h1 = (h.name for h in cluster.hosts)

    first = stage(cluster, work, hosts, src)
    total = 1680 + 300_000
    assert f"data on {h0}: 2 of 2 files changed, {total} bytes sent" in first
    assert f"data on {h1}: 2 of 2 files changed, {total} bytes sent" in first
    assert "DONE step=3" in first

    (src / "input.txt").write_text("all the world's a stage. " * 40)  # 1000 bytes
    one = stage(cluster, work, hosts, src)
    assert f"data on {h0}: 1 of 2 files changed, 1000 bytes sent" in one
    assert f"data on {h1}: 1 of 2 files changed, 1000 bytes sent" in one

    # The folder unchanged since: node 0's copy moves nothing (an `up` of its own for that, on both nodes, cost a job
    # start more), node 1's corrupted file is found and sent again, alone.
    on_node1 = cluster.hosts[1].path(f"{DATA_DIR}/extra.bin")
    with on_node1.open("r+b") as fh:  # a flipped block, same size
        fh.write(b"\0" * 4096)
    repaired = stage(cluster, work, hosts, src)
    assert f"data on {h0}: up to date, nothing moved (2 files)" in repaired
    assert f"data on {h1}: 1 of 2 files changed, 300000 bytes sent" in repaired
    assert on_node1.read_bytes() == (src / "extra.bin").read_bytes()
    assert cluster.hosts[1].foreign_files(DATA_DIR) == []  # every file the login's own
