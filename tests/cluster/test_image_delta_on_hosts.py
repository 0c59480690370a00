"""Image delivery by layers on real test hosts: after a one-line change to trainer/, the next `up` sends each
node only the new layer, and the node then runs the new image.

Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE) built from this tree's Dockerfile.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.image_kit import build_changed_image
from kit.orchestrate_kit import IMAGE, Data, job_containers, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
CHANGED = f"{IMAGE}-delta-test"


@pytest.fixture(scope="module")
def fresh(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """2 hosts of the module's own, seeded: they start with the previous build, as the nodes of a change do (the
    full transfer is the image-pull tests' subject, not this one's)."""
    c = cluster_factory(2, fresh=True, seeded=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(fresh: Cluster) -> Cluster:
    return fresh


@pytest.fixture(scope="module")
def changed() -> Iterator[dict[str, tuple[str, str]]]:
    """One rebuild per layer source (another line each), so that each `up` finds its nodes a layer behind."""
    # A line of its own per run: the cache (out/test-cache) outlives a run, the changed layer must be new to it.
    tags = {source: (f"{CHANGED}-{source}", build_changed_image(IMAGE, f"{CHANGED}-{source}",
                                                                line=f"{source} {uuid.uuid4().hex}"))
            for source in ("off", "on")}
    yield tags
    for tag, _ in tags.values():
        docker.from_env().images.remove(tag, noprune=False)


@pytest.mark.parametrize("source", ["on", "off"])
def test_up_after_a_trainer_change_sends_only_the_new_layer(fresh: Cluster, work: Path, data: Data, hosts: Path,
                                                            changed: dict[str, tuple[str, str]], source: str) -> None:
    """--layer-cache on: the blobs of the local layer cache; off: filtered from one `docker save` stream."""
    tag, image_id = changed[source]
    for h in fresh.hosts:  # the nodes hold the previous build (seeded), not through the registry
        assert h.docker_client().images.list(name=IMAGE), h.name
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, f"delta-{source}", "--image", tag, "--timings",
                                                      "--layer-cache", source, trainer=("--epochs", "1")))
    assert res.returncode == 0
    layers = len(docker.from_env().images.get(tag).attrs["RootFS"]["Layers"])
    for h in fresh.hosts:
        found = re.search(rf"image {re.escape(tag)} on {h.name}: sent ([\d.]+) MB \((\d+) of (\d+) layers\) "
                          rf"of (\d+) MB", res.stdout)
        assert found, f"no transfer summary for {h.name}"
        sent_mb, k, m, total_mb = float(found[1]), int(found[2]), int(found[3]), int(found[4])
        assert (k, m) == (1, layers) and sent_mb <= 1.0 and total_mb > 100
        assert "layer delta failed" not in res.stdout
    cache_line = re.search(rf"^image {re.escape(tag)}: local layer cache has it \((\d+) new layers? of {layers},",
                           res.stdout, re.M)
    if source == "on":  # the cache held the previous build's layers or gets them now; the changed one is new
        assert cache_line and 1 <= int(cache_line[1]) <= layers
    else:
        assert cache_line is None and "layer cache" not in res.stdout
    assert "finished: epochs=1" in res.stdout
    assert re.search(r"^timings \(s\): connect [\d.]+, preflight [\d.]+, plan [\d.]+, image [\d.]+, "
                     r"data [\d.]+, start [\d.]+, run [\d.]+, summary [\d.]+; total [\d.]+$", res.stdout, re.M)
    ran = {name: c.attrs["Image"] for name, c in job_containers(fresh, f"delta-{source}")}  # type: ignore[attr-defined]
    assert ran == {h.name: image_id for h in fresh.hosts}
