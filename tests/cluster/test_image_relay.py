"""`up --relay` on the session's three test hosts: a new layer leaves this machine once (to node 0), the other
two nodes fetch it from node 0 inside the cluster; a node whose connection to the relay is refused is sent the
layer from here, with one line saying why, and the job runs. The `--data-from` files the same way.

Bytes out of this machine are counted outside the orchestrator: the cluster's bridge device in this machine's
namespace transmits what this machine sends to the hosts (frames between two hosts' ports are forwarded by the
bridge without passing its own device). Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.orchestrate_kit import IMAGE, Data, example_image, job_containers, orchestrate, up, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
LAYER = 24_000_000  # random bytes: the new layer compresses to about this size
REFUSE = ["OUTPUT", "-p", "tcp", "-m", "string", "--algo", "bm", "--string", "DDP-RELAY", "-j", "REJECT",
          "--reject-with", "tcp-reset"]


@pytest.fixture(scope="module")
def target(cluster_factory, cpu_image: str) -> Cluster:  # type: ignore[no-untyped-def]
    return cluster_factory(3, no_sftp=[2])  # the session's three hosts, seeded with the CPU image


def _with_random_layer(tag: str) -> str:
    """`tag`: IMAGE plus one layer of LAYER random bytes, which no host holds. Returns its image ID."""
    with tempfile.TemporaryDirectory(prefix="ddp-relay-") as tmp:
        Path(tmp, "blob").write_bytes(os.urandom(LAYER))
        Path(tmp, "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY blob /relay-test-blob\n")
        subprocess.run(["docker", "build", "-q", "-t", tag, tmp], check=True, capture_output=True, timeout=300,
                       env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return str(docker.from_env().images.get(tag).id)


@pytest.fixture(scope="module")
def images() -> Iterator[list[tuple[str, str]]]:
    tags = [f"{IMAGE}-relay-test-{i}" for i in range(2)]
    yield [(tag, _with_random_layer(tag)) for tag in tags]
    for tag in tags:
        docker.from_env().images.remove(tag, noprune=False)


def _bytes_out(cluster: Cluster) -> int:
    return int(Path(f"/sys/class/net/{cluster.state.bridge}/statistics/tx_bytes").read_text())


def test_the_new_layer_leaves_once_and_the_other_nodes_fetch_it_from_node_0(
        target: Cluster, work: Path, data: Data, hosts: Path, images: list[tuple[str, str]]) -> None:
    h0, h1, h2 = target.hosts
    (tag, image_id), (tag2, image_id2) = images
    layers = len(docker.from_env().images.get(tag).attrs["RootFS"]["Layers"])
    # the CIFAR archive from here (--data-from) into a data dir no other test fills: relayed like the layer
    archive_hosts = target.write_hosts_file(work / "hosts-archive.txt",
                                            keys={h.index: {"data_dir": "/home/ddp/relay-archive"} for h in target.hosts})
    args = up_args(archive_hosts, data, "relay", "--image", tag, trainer=("--epochs", "1"))
    at = args.index("--data-url")
    args[at:at + 2] = ["--data-from", str(data.archive)]
    before = _bytes_out(target)
    res = orchestrate(target, work / "state", *args)
    out = _bytes_out(target) - before
    assert res.returncode == 0
    sent = LAYER + data.archive.stat().st_size
    print(f"bytes out of this machine: {out / 1e6:.1f} MB for a {LAYER / 1e6:.0f} MB layer and a "
          f"{data.archive.stat().st_size / 1e6:.1f} MB archive to 3 nodes")
    assert sent <= out <= 1.3 * sent  # sent to every node from here: 3x
    assert f"data on {h0.name}: sent {data.archive.stat().st_size} bytes" in res.stdout
    for h in (h1, h2):
        assert f"data on {h.name}: archive fetched from the relay on {h0.name}, 0 bytes sent from here" in res.stdout
    assert re.search(rf"image {re.escape(tag)} on {h0.name}: sent ([\d.]+) MB \(1 of {layers} layers\)", res.stdout)
    for h in (h1, h2):
        assert f"image {tag} on {h.name}: 1 of {layers} layers fetched from the relay on {h0.name}, 0 MB sent from " \
               "here" in res.stdout
    assert {name: c.attrs["Image"] for name, c in job_containers(target, "relay")} == {  # type: ignore[attr-defined]
        h.name: image_id for h in target.hosts}
    assert [f for h in target.hosts for f in h.path(f"{h.home}/.cache/ddp-cifar/relay").glob("*")] == []  # removed

    h2.run(["iptables", "-A", *REFUSE])  # node 2 cannot get the relay's bytes: its request is reset
    try:
        res = orchestrate(target, work / "state", *up_args(hosts, data, "relay", "--image", tag2,
                                                           trainer=("--epochs", "1")))
    finally:
        h2.run(["iptables", "-D", *REFUSE])
    assert res.returncode == 0
    assert re.search(rf"^image {re.escape(tag2)} on {h2.name}: could not fetch from the relay on {h0.name} \(cannot "
                     r"reach the relay: .*\); sending its layers from here$", res.stdout, re.M)
    assert f"image {tag2} on {h1.name}: 1 of {layers} layers fetched from the relay on {h0.name}" in res.stdout
    assert re.search(rf"image {re.escape(tag2)} on {h2.name}: sent ([\d.]+) MB \(1 of {layers} layers\)", res.stdout)
    assert {name: c.attrs["Image"] for name, c in job_containers(target, "relay")} == {  # type: ignore[attr-defined]
        h.name: image_id2 for h in target.hosts}


DATA_BYTES = 24_000_000  # random: what leaves this machine is about this much once, or 3x without the relay
DATA_DIR = "/home/ddp/relay-data"


def test_the_data_leaves_once_and_the_other_nodes_fetch_it_from_node_0(target: Cluster, work: Path) -> None:
    h0, h1, h2 = target.hosts
    src = work / "relay-data"
    src.mkdir()
    (src / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    blob = os.urandom(DATA_BYTES)
    (src / "blob.bin").write_bytes(blob)
    hosts = target.write_hosts_file(work / "hosts-data.txt", keys={h.index: {"data_dir": DATA_DIR} for h in target.hosts})
    image = example_image("charlm")
    before = _bytes_out(target)
    res = up(target, work, hosts, "relaydata", image, "-m charlm.train", "--data-from", str(src),
             args=["--steps", "1", "--step-seconds", "0", "--ckpt-every", "1000", "--text", "input.txt", "--context", "4"])
    out = _bytes_out(target) - before
    assert res.returncode == 0, res.stderr
    print(f"bytes out of this machine: {out / 1e6:.1f} MB for {DATA_BYTES / 1e6:.0f} MB of data to 3 nodes")
    assert DATA_BYTES <= out <= 1.3 * DATA_BYTES  # sent to every node from here: 3x
    assert re.search(rf"^data on {h0.name}: 2 of 2 files changed, \d+ bytes sent$", res.stdout, re.M)
    for h in (h1, h2):
        assert f"data on {h.name}: 2 of 2 files changed, fetched from the relay on {h0.name}, 0 bytes sent from " \
               "here" in res.stdout
        assert h.path(f"{DATA_DIR}/blob.bin").read_bytes() == blob
    assert [f for h in target.hosts for f in h.path(f"{h.home}/.cache/ddp-cifar/relay").glob("*")] == []  # removed
