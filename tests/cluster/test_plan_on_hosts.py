"""`up --dry-run=hosts --json` on two stock test hosts that hold nothing yet: it probes them and changes nothing,
and the plan it prints is what `up` then applies (the containers' arguments read back from the daemons, the layers
sent, the data moved).

Needs root, the local dockerd and the CPU image (DDP_TEST_IMAGE): real sshd, dockerd and the orchestrator.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from orchestrate_kit import IMAGE, Data, job_containers, orchestrate, up_args

from devcluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]
JOB = "planned"


@pytest.fixture(scope="module")
def target(cluster_factory) -> Cluster:  # type: ignore[no-untyped-def]
    """Two fresh hosts: no image, no data, no job folders."""
    return cluster_factory(2, fresh=True)


def _snapshot(cluster: Cluster) -> list[dict[str, Any]]:
    """Per host: every container and image its daemon holds, and every file and folder under the login's home
    (the job's default folders lie there), with sizes and times."""
    out = []
    for h in cluster.hosts:
        client = h.docker_client()
        try:
            containers = sorted(c.id for c in client.containers.list(all=True))
            images = sorted(i.id for i in client.images.list(all=True))
        finally:
            client.close()
        home = h.path(h.home)
        files = sorted((str(p.relative_to(home)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in home.rglob("*"))
        out.append({"containers": containers, "images": images, "files": files})
    return out


def _dry_run(cluster: Cluster, state: Path, hosts: Path, data: Data) -> dict[str, Any]:
    res = orchestrate(cluster, state, *up_args(hosts, data, JOB, "--dry-run=hosts", "--json"))
    assert res.returncode == 0, res.stderr
    plan: dict[str, Any] = json.loads(res.stdout)  # stdout is the plan alone; the preflight table went to stderr
    return plan


def test_a_dry_run_on_hosts_changes_nothing_and_up_applies_what_it_printed(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state = work / "state"
    before = _snapshot(target)
    plan = _dry_run(target, state, hosts, data)
    assert _snapshot(target) == before  # no folder, file, image or container created, sent or started

    nodes = plan["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1] and plan["attempt"] == {"number": 0, "cause": "", "resume": False}
    for i, n in enumerate(nodes):
        home = target.hosts[i].home
        assert all(d.startswith(f"{home}/") for d in n["dirs"].values()), n["dirs"]  # resolved: no ~ left
        assert n["image"]["kind"] == "send" and n["image"]["layers_sent"] == n["image"]["layers"] > 0
        assert n["data"]["kind"] == "download" and n["leftovers"] == []
        assert all(c["ok"] for c in n["checks"])
        assert n["container"]["image"] == IMAGE and n["docker_run"][:2] == ["docker", "run"]

    res = orchestrate(target, state, *up_args(hosts, data, JOB, "--detach"))
    assert res.returncode == 0, res.stderr
    try:
        _assert_applied(target, nodes, res.stdout)
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
