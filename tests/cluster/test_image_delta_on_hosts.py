"""Image delivery by layers on real test hosts: after a one-line change to trainer/, the next `up` sends each
node only the new layer, and the node then runs the new image.

Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE) built from this tree's Dockerfile.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from image_kit import build_changed_image, load_image
from orchestrate_kit import IMAGE, Data, job_containers, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
CHANGED = f"{IMAGE}-delta-test"


@pytest.fixture(scope="module")
def fresh(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    c = cluster_factory(2, fresh=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(fresh: Cluster) -> Cluster:
    return fresh


@pytest.fixture(scope="module")
def changed() -> Iterator[str]:
    image_id = build_changed_image(IMAGE, CHANGED)
    yield image_id
    docker.from_env().images.remove(CHANGED, noprune=False)


def test_up_after_a_trainer_change_sends_only_the_new_layer(fresh: Cluster, work: Path, data: Data, hosts: Path,
                                                            changed: str) -> None:
    for h in fresh.hosts:  # the nodes hold the previous build
        load_image(IMAGE, h.docker_host)
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "delta", "--image", CHANGED, "--timings",
                                                      trainer=("--epochs", "1")))
    assert res.returncode == 0
    layers = len(docker.from_env().images.get(CHANGED).attrs["RootFS"]["Layers"])
    for h in fresh.hosts:
        found = re.search(rf"image {re.escape(CHANGED)} on {h.name}: sent ([\d.]+) MB \((\d+) of (\d+) layers\) "
                          rf"of (\d+) MB", res.stdout)
        assert found, f"no transfer summary for {h.name}"
        sent_mb, k, m, total_mb = float(found[1]), int(found[2]), int(found[3]), int(found[4])
        assert (k, m) == (1, layers) and sent_mb <= 1.0 and total_mb > 100
        assert "layer delta failed" not in res.stdout
    assert "finished: epochs=1" in res.stdout
    assert re.search(r"^timings \(s\): connect [\d.]+, preflight [\d.]+, image [\d.]+, data [\d.]+, start [\d.]+, "
                     r"run [\d.]+, summary [\d.]+; total [\d.]+$", res.stdout, re.M)
    ran = {name: c.attrs["Image"] for name, c in job_containers(fresh, "delta")}  # type: ignore[attr-defined]
    assert ran == {h.name: changed for h in fresh.hosts}
