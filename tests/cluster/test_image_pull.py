"""`up --pull`, and a first delivery whose base the nodes pull themselves, against a real registry: Debian's
`docker-registry` (distribution 2.8) served over plain HTTP on the test network's gateway, which the test hosts'
daemons list as an insecure registry (as a site lists its own; nvcr.io needs no such entry).

Needs root, the local dockerd, `apt-get install docker-registry` and the CPU image (DDP_TEST_IMAGE).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.image_kit import REPO, load_image
from kit.net import free_port
from kit.orchestrate_kit import IMAGE, Data, job_containers, orch_env, orchestrate, up_args, wait_for

from devcluster import Cluster, Host
from devcluster.tinyimage import load_tiny_image

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
REGISTRY = shutil.which("docker-registry")


@pytest.fixture(scope="module")
def fresh(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """2 hosts of the module's own, seeded with the CPU image: what they pull is new above it (the test image has a
    layer of its own; the base test's is built on a base of its own). Empty hosts cost a load of 0.9 GB into host 0
    and a pull of 0.9 GB into host 1 and added nothing: which layers a pull brings is the daemon's business, that
    it pulls is ours; the whole image to empty hosts is the first `up`'s subject
    (tests/cluster/test_orchestrate_up.py::test_first_up_moves_image_and_data_and_trains_one_proc_per_node)."""
    c = cluster_factory(2, fresh=True, seeded=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(fresh: Cluster) -> Cluster:
    return fresh


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
    port = free_port(fresh.gateway)
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
    # Publish: host 0 builds the image (its seeded CPU image and one small layer of its own) and pushes it (the
    # local dockerd does not trust the gateway's registry). Built there, not here and loaded: a `docker save` of
    # 0.9 GB and its load cost ~40 CPU-seconds for the same image.
    name = f"{registry}/ddp-cifar:pull-test"
    h0, h1 = fresh.hosts
    with tempfile.TemporaryDirectory(prefix="ddp-cifar-pull-") as tmp:
        (Path(tmp) / "stamp").write_text(uuid.uuid4().hex)  # no host holds this layer
        (Path(tmp) / "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY stamp /stamp\n")
        subprocess.run(["docker", "-H", h0.docker_host, "build", "-q", "-t", name, tmp], check=True,
                       capture_output=True, timeout=120, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    h0.run(["docker", "push", name], timeout=300)
    pushed = h0.docker_client().images.get(name).id
    assert name not in {t for i in h1.docker_client().images.list() for t in i.tags}
    res = orchestrate(fresh, work / "state", *up_args(hosts, data, "pull", "--image", name, "--pull",
                                                      trainer=("--max-steps", "1")))
    assert res.returncode == 0
    assert f"image {name} on {h0.name}: already there, nothing sent" in res.stdout
    assert f"image {name} on {h1.name}: pulled" in res.stdout
    assert h1.docker_client().images.get(name).id == pushed
    assert {n: c.attrs["Image"] for n, c in job_containers(fresh, "pull")} == {h0.name: pushed, h1.name: pushed}  # type: ignore[attr-defined]


@pytest.fixture
def on_base(registry: str, fresh: Cluster) -> Iterator[tuple[str, str, str]]:
    """A small base in the registry (the tiny image plus a layer of its own, so no host holds it yet), pushed from
    host 0, which then removes it again; and the project's image built on it here, with the Dockerfile's labels.
    Yields (image, the base pinned to its digest, the base's tag); the local images are removed after."""
    uid = uuid.uuid4().hex[:12]
    tiny, base, image = f"ddp-cifar-test-tiny:{uid}", f"{registry}/ddp-cifar-test-base:{uid}", f"ddp-cifar-test-onbase:{uid}"
    local, build = docker.from_env(), {**os.environ, "DOCKER_BUILDKIT": "0"}
    load_tiny_image(local, tiny)
    try:
        with tempfile.TemporaryDirectory(prefix="ddp-cifar-base-") as tmp:
            (Path(tmp) / "stamp").write_text(uid)
            (Path(tmp) / "Dockerfile").write_text(f"FROM {tiny}\nCOPY stamp /stamp\n")
            subprocess.run(["docker", "build", "-q", "-t", base, tmp], check=True, capture_output=True, timeout=120,
                           env=build)
        yield image, _push_from(fresh.hosts[0], base), base
    finally:
        for name in (image, base, tiny):
            try:
                local.images.remove(name)
            except docker.errors.ImageNotFound:
                pass


def _push_from(h0: Host, base: str) -> str:
    """Host 0 pushes the base and removes it again (the test needs hosts without it); returns it pinned."""
    load_image(base, h0.docker_host)
    h0.run(["docker", "push", base], timeout=120)
    pushed = h0.docker_client().images.get(base)
    pinned = next(d for d in pushed.attrs["RepoDigests"] if d.startswith(base.rsplit(":", 1)[0] + "@"))
    h0.docker_client().images.remove(pushed.id, force=True)
    return str(pinned)


def _build_on(base: str, pinned: str, image: str) -> None:
    """The project's image, from this tree's Dockerfile, on the base (its labels name the base and its digest)."""
    subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base}", "--build-arg",
                    f"BASE_DIGEST={pinned.split('@')[1]}", "-t", image, str(REPO)], check=True, capture_output=True,
                   timeout=300, env={**os.environ, "DOCKER_BUILDKIT": "0"})


def _sent(out: str, image: str, host: str) -> tuple[float, int, int]:
    found = re.search(rf"image {re.escape(image)} on {host}: sent ([\d.]+) MB \((\d+) of (\d+) layers\)", out)
    assert found, f"no transfer summary for {host}"
    return float(found[1]), int(found[2]), int(found[3])


def test_a_fresh_node_pulls_the_base_itself_and_gets_only_the_layers_above_it(
        fresh: Cluster, work: Path, hosts: Path, registry: str, on_base: tuple[str, str, str]) -> None:
    """Host 0 reaches the registry: it pulls the base and receives the layers above it. Host 1's packets to the
    registry are refused (iptables in its network namespace): one line says why, and it receives every layer."""
    h0, h1 = fresh.hosts
    image, pinned, base = on_base
    _build_on(base, pinned, image)
    port = registry.rsplit(":", 1)[1]
    refuse = ["OUTPUT", "-p", "tcp", "-d", fresh.gateway, "--dport", port, "-j", "REJECT", "--reject-with", "tcp-reset"]
    h1.run(["iptables", "-I", *refuse])
    try:
        res = subprocess.run([sys.executable, str(REPO / "tests" / "cluster" / "image_phase_on_hosts.py"), str(hosts),
                              image], env=orch_env(fresh, work / "state"), cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    finally:
        h1.run(["iptables", "-D", *refuse])
    print(res.stdout, res.stderr)
    assert res.returncode == 0
    local = docker.from_env().images.get(image)
    layers, base_layers = len(local.attrs["RootFS"]["Layers"]), len(docker.from_env().images.get(base).attrs["RootFS"]["Layers"])
    assert f"#   image: pull base {pinned} on the node (its {base_layers} layers), then send " \
           f"{layers - base_layers} of {layers} layers" in res.stdout
    assert re.search(rf"#   image: send {layers} of {layers} layers, .*\(base not pulled by the node: its registry "
                     r"does not answer the node's daemon \(.+\)\), from here$", res.stdout, re.M)  # 2 nodes: no relay
    assert f"image {image} on {h0.name}: pulled base {pinned} from its registry" in res.stdout
    assert len(re.findall(rf"^image {re.escape(image)} on {h1.name}: base not pulled by the node: .+; sending its "
                          r"layers$", res.stdout, re.M)) == 1
    above, everything = _sent(res.stdout, image, h0.name), _sent(res.stdout, image, h1.name)
    print(f"bytes sent per node: {above[0]:.2f} MB with the base pulled by the node, {everything[0]:.2f} MB without")
    assert above[1:] == (layers - base_layers, layers) and everything[1:] == (layers, layers)
    assert above[0] * 1e6 < docker.from_env().images.get(base).attrs["Size"] and above[0] < everything[0]
    assert h0.docker_client().images.get(pinned).attrs["RootFS"]["Layers"] == local.attrs["RootFS"]["Layers"][:base_layers]
    for h in (h0, h1):
        assert h.docker_client().images.get(image).id == local.id
