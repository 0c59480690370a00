"""`up --dry-run=hosts --json` on two stock test hosts that hold no data, job folder or container yet, and the
previous build of the image (seeded) but not the job's: it probes them and changes nothing, and the plan it prints
is what `up` then applies (the containers' arguments read back from the daemons, the layers sent, the data moved),
every container of the attempt included: the short data fetch and network check containers are the plan's, each
as the daemon's own events tell it was created, and no container is created that the plan does not hold.

The job's image is the CPU image with one changed line (kit.image_kit.build_changed_image), so the plan sends some
of its layers and not others, and `up` must send exactly those: a plan of every layer, as on empty hosts, would
check less (every layer is any count's upper bound). Sending the whole image to empty hosts is the first `up`'s
subject (tests/cluster/test_orchestrate_up.py::test_first_up_moves_image_and_data_and_trains_one_proc_per_node);
here it cost two loads of 0.9 GB for nothing the plan adds.

Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE): real sshd, dockerd and the orchestrator.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from kit.image_kit import build_changed_image
from kit.orchestrate_kit import IMAGE, Data, job_containers, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
JOB = "planned"


@pytest.fixture(scope="module")
def target(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """Two hosts of the module's own: the CPU image (seeded), no data, no job folders."""
    c = cluster_factory(2, fresh=True, seeded=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The CPU image with one line changed: new to the hosts above its changed layer."""
    tag = f"{IMAGE}-plan-test"
    build_changed_image(IMAGE, tag, line=f"plan {uuid.uuid4().hex}")  # new to the layer cache of any earlier run
    yield tag
    docker.from_env().images.remove(tag, noprune=False)


# Where a run on a host writes: the login's home (the job's default folders), and the two temporary folders, which
# each test host has of its own (its mount namespace) and where a careless script would stage or lock.
SNAPSHOT_ROOTS = ("HOME", "/tmp", "/var/tmp")


def _files(h: Any, root: str) -> list[tuple[str, int, int]]:
    top = h.path(h.home if root == "HOME" else root)
    return sorted((f"{root}/{p.relative_to(top)}", p.lstat().st_size, p.lstat().st_mtime_ns) for p in top.rglob("*"))


def _snapshot(cluster: Cluster) -> list[dict[str, Any]]:
    """Per host: every container and image its daemon holds, and every file and folder under the login's home,
    /tmp and /var/tmp, with sizes and times."""
    out = []
    for h in cluster.hosts:
        client = h.docker_client()
        try:
            containers = sorted(c.id for c in client.containers.list(all=True))
            images = sorted(i.id for i in client.images.list(all=True))
        finally:
            client.close()
        files = [f for root in SNAPSHOT_ROOTS for f in _files(h, root)]
        out.append({"containers": containers, "images": images, "files": files})
    return out


def _container_events(cluster: Cluster, since: float, until: float) -> list[tuple[str, str]]:
    """(host, action) of every container event each daemon logged in [since, until]: a container created and
    removed meanwhile leaves no trace in a snapshot, but it does here."""
    out = []
    for h in cluster.hosts:
        client = h.docker_client()
        try:
            events = client.events(since=int(since), until=int(until) + 1, decode=True,
                                   filters={"type": "container"})
            out += [(h.name, str(e.get("Action"))) for e in events]
        finally:
            client.close()
    return out


def _created(cluster: Cluster, since: float, until: float) -> dict[str, list[dict[str, str]]]:
    """Per host, the attributes of every container its daemon created in [since, until]: its name, image and
    labels (the create event's), also of a short container removed since."""
    out: dict[str, list[dict[str, str]]] = {}
    for h in cluster.hosts:
        client = h.docker_client()
        try:
            events = client.events(since=int(since), until=int(until) + 1, decode=True,
                                   filters={"type": "container", "event": "create"})
            out[h.name] = [dict(e["Actor"]["Attributes"]) for e in events]
        finally:
            client.close()
    return out


def _dry_run(cluster: Cluster, state: Path, hosts: Path, data: Data, image: str) -> dict[str, Any]:
    res = orchestrate(cluster, state, *up_args(hosts, data, JOB, "--check-network", "--dry-run=hosts", "--json",
                                               image=image))
    assert res.returncode == 0, res.stderr
    plan: dict[str, Any] = json.loads(res.stdout)  # stdout is the plan alone; the preflight table went to stderr
    return plan


def test_a_dry_run_on_hosts_changes_nothing_and_up_applies_what_it_printed(
        target: Cluster, work: Path, data: Data, hosts: Path, image: str) -> None:
    state = work / "state"
    before, t0 = _snapshot(target), time.time()
    plan = _dry_run(target, state, hosts, data, image)
    assert _snapshot(target) == before  # no folder, file, image or container created, sent or started
    assert _container_events(target, t0, time.time()) == []  # none started and removed meanwhile either

    nodes = plan["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1] and plan["attempt"] == {"number": 0, "cause": "", "resume": False}
    for i, n in enumerate(nodes):
        home = target.hosts[i].home
        assert all(d.startswith(f"{home}/") for d in n["dirs"].values()), n["dirs"]  # resolved: no ~ left
        assert n["image"]["kind"] == "send" and 0 < n["image"]["layers_sent"] < n["image"]["layers"], n["image"]
        assert n["data"]["kind"] == "download" and n["leftovers"] == []
        assert all(c["ok"] for c in n["checks"])
        assert n["container"]["image"] == image and n["docker_run"][:2] == ["docker", "run"]
        assert n["gpu_probe"] is None and n["fetch"] and n["network_check"]  # CPU hosts: no GPU probe
    assert plan["image_check"]["container"]["image"] == image  # run here, before the plan (its launcher)

    t1 = time.time()
    res = orchestrate(target, state, *up_args(hosts, data, JOB, "--check-network", "--detach", image=image))
    assert res.returncode == 0, res.stderr
    try:
        _assert_applied(target, nodes, res.stdout)
        _assert_every_container_planned(target, nodes, _created(target, t1, time.time()))
    finally:
        killed = orchestrate(target, state, "kill", "--job", JOB)
    assert killed.returncode == 0 and job_containers(target, JOB) == []


def _assert_applied(cluster: Cluster, nodes: list[dict[str, Any]], out: str) -> None:
    by_host = dict(job_containers(cluster, JOB))
    for i, n in enumerate(nodes):
        label = cluster.hosts[i].name
        layers = re.search(rf"^image \S+ on {re.escape(label)}: sent [\d.]+ MB \((\d+) of (\d+) layers?\)", out, re.M)
        assert layers and (int(layers[1]), int(layers[2])) == (n["image"]["layers_sent"], n["image"]["layers"]), out
        assert re.search(rf"^data on {re.escape(label)}: downloaded \d+ bytes$", out, re.M), out
        _assert_same_container(n["container"], by_host[label].attrs)  # type: ignore[attr-defined]


def _assert_every_container_planned(cluster: Cluster, nodes: list[dict[str, Any]],
                                    created: dict[str, list[dict[str, str]]]) -> None:
    """Each host's daemon created exactly the containers the plan printed for its node: the job's, the data fetch
    and the network check, each with the planned image, labels and name (Docker names the unnamed fetch)."""
    for i, n in enumerate(nodes):
        planned = [n["container"], n["fetch"]["container"], n["network_check"]["container"]]
        got = created[cluster.hosts[i].name]
        assert len(got) == len(planned), (got, planned)
        for want in planned:
            same = [a for a in got if a["image"] == want["image"] and want["labels"].items() <= a.items()
                    and (want["name"] is None or a["name"] == want["name"])]
            assert len(same) == 1, (want["labels"], got)


def _assert_same_container(planned: dict[str, Any], attrs: dict[str, Any]) -> None:
    """The planned Docker SDK arguments against what the daemon holds for the container it created."""
    config, host = attrs["Config"], attrs["HostConfig"]
    assert attrs["Name"] == "/" + planned["name"]
    assert (config["Image"], config["Cmd"], config["User"], config["StopSignal"]) == \
        (planned["image"], planned["command"], planned["user"], planned["stop_signal"])
    assert {f"{k}={v}" for k, v in planned["environment"].items()} <= set(config["Env"])
    assert planned["labels"].items() <= config["Labels"].items()
    assert (host["NetworkMode"], host["Init"], host["IpcMode"], host["Privileged"]) == \
        (planned["network_mode"], planned["init"], planned["ipc_mode"], planned["privileged"])
    assert host["Ulimits"] == planned["ulimits"] and host["ExtraHosts"] == planned["extra_hosts"]
    mounts = [(m["Source"], m["Target"], m.get("ReadOnly", False)) for m in host["Mounts"]]
    assert mounts == [(m["Source"], m["Target"], m.get("ReadOnly", False)) for m in planned["mounts"]]
