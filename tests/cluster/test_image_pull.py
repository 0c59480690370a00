"""`up --pull` against a real registry: Debian's `docker-registry` (distribution 2.8) served over plain HTTP on
the test network's gateway, which the test hosts' daemons list as an insecure registry.

Needs root, the local dockerd, `apt-get install docker-registry` and the CPU image (DDP_TEST_IMAGE).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from image_kit import load_image
from orchestrate_kit import IMAGE, Data, job_containers, orchestrate, up_args, wait_for

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
REGISTRY = shutil.which("docker-registry")


@pytest.fixture(scope="module")
def fresh(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    c = cluster_factory(2, fresh=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(fresh: Cluster) -> Cluster:
    return fresh


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as res:
            return res.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def registry(fresh: Cluster, work: Path) -> Iterator[str]:
    """A registry on the gateway (host:port), its storage under `work`; stopped at the end."""
    if REGISTRY is None:
        pytest.fail("docker-registry is missing: apt-get install docker-registry", pytrace=False)
    port = _free_port(fresh.gateway)
    config = work / "registry.yml"
    config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {work / 'registry'}\n"
                      f"http:\n  addr: {fresh.gateway}:{port}\n")
    proc = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _answers(f"http://{fresh.gateway}:{port}/v2/"), 30, "the registry to answer", every=0.2)
        yield f"{fresh.gateway}:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_up_pull_gets_the_image_from_the_registry(fresh: Cluster, work: Path, data: Data, hosts: Path,
                                                  registry: str) -> None:
    # Publish: host 0 loads the image and pushes it (the local dockerd does not trust the gateway's registry).
    name = f"{registry}/ddp-cifar:pull-test"
    h0, h1 = fresh.hosts
    load_image(IMAGE, h0.docker_host)
    h0.run(["docker", "tag", IMAGE, name])
    h0.run(["docker", "push", name], timeout=300)
    pushed = h0.docker_client().images.get(name).id
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "pull", "--image", name, "--pull",
                                                      trainer=("--max-steps", "1")))
    assert res.returncode == 0
    assert f"image {name} on {h0.name}: already there, nothing sent" in res.stdout
    assert f"image {name} on {h1.name}: pulled" in res.stdout
    assert h1.docker_client().images.get(name).id == pushed
    assert {n: c.attrs["Image"] for n, c in job_containers(fresh, "pull")} == {h0.name: pushed, h1.name: pushed}  # type: ignore[attr-defined]
