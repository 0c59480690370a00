"""A data folder that every host sees (an NFS home or a /data mount, the usual case on small clusters): detected
with a token file, fetched once for all the hosts that share it, and the job trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit.orchestrate_kit import Data, job_containers, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def target(cluster_shared: Cluster) -> Cluster:
    return cluster_shared


def test_shared_data_folder_is_fetched_once(target: Cluster, work: Path, data: Data, tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    assert target.shared is not None
    hosts = target.write_hosts_file(tmp_path / "hosts.txt",
                                    keys={i: {"data_dir": f"{target.shared}/data"} for i in range(2)})
    capfd.readouterr()  # the HTTP server logs each request to this process's stderr
    res = orchestrate(target, work / "state", *up_args(hosts, data, "nfs", trainer=("--epochs", "1")))
    requests = capfd.readouterr().err.count("GET /cifar-synth.tar.gz")
    print(res.stdout)
    assert res.returncode == 0, res.stderr
    h0, h1 = target.hosts
    assert f"data on {h0.name}: downloaded" in res.stdout
    assert f"data on {h1.name}: same folder as on {h0.name} (shared storage), nothing moved" in res.stdout
    assert requests == 1
    assert "finished: epochs=1" in res.stdout and "world_size=2" in res.stdout
    assert orchestrate(target, work / "state", "kill", "--job", "nfs").returncode == 0
    assert job_containers(target, "nfs") == []
