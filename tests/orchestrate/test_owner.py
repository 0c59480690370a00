"""Owned jobs (docs/shared-hosts.md): owner labels, whose containers a command sees and touches, `status --all`."""

from __future__ import annotations

import io
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from kit.units import job_specs
from rich.console import Console

from orchestrate import labels
from orchestrate.backends.docker_ssh import DockerSSH, owner
from orchestrate.backends.docker_ssh import control as jobs
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import JobError
from orchestrate.hosts import Host
from orchestrate.jobs.commands import print_all_jobs
from orchestrate.labels import JOB_LABEL, RANK_LABEL
from orchestrate.probe.observations import NodeFacts

ALICE, BOB = 1000, 1001


class _Container:
    def __init__(self, name: str, job: str, uid: int | None, rank: int = 0, status: str = "running",
                 attrs: dict[str, Any] | None = None) -> None:
        self.name, self.status = name, status
        self.labels = {JOB_LABEL: job, RANK_LABEL: str(rank)}
        if uid is not None:
            self.labels |= labels.owner_labels(f"{uid}:{uid}", {ALICE: "alice", BOB: "bob"}[uid])
        self.attrs = attrs or {"State": {"ExitCode": 0}}
        self.stopped = self.removed = False

    def stop(self, timeout: int) -> None:
        self.stopped = True

    def reload(self) -> None:
        pass

    def remove(self, force: bool) -> None:
        self.removed = True


class _Client:
    def __init__(self, containers: list[_Container]) -> None:
        outer = containers

        class _Containers:
            @staticmethod
            def list(all: bool, filters: dict[str, str], ignore_removed: bool = False) -> list[_Container]:  # noqa: A002  # docker-py's name
                key, _, value = filters["label"].partition("=")
                return [c for c in outer if key in c.labels and (not value or c.labels[key] == value)]

        self.containers = _Containers()


def test_a_container_is_mine_when_its_uid_is_mine_or_it_has_no_owner_label() -> None:
    assert labels.is_mine(labels.owner_labels("1000:1000", "alice"), ALICE)
    assert not labels.is_mine(labels.owner_labels("1001:1001", "bob"), ALICE)
    assert labels.is_mine({JOB_LABEL: "cifar"}, ALICE)  # an older version's container: the caller's (migration)
    assert labels.owner_labels(None, None) == {}  # an offline dry run does not know the login yet


def test_the_plan_labels_each_container_with_its_owner_and_names_it_after_the_login() -> None:
    hosts = [Host(name="a", hostname="10.0.0.1", port=22, user="u"), Host(name="b", hostname="10.0.0.2", port=22, user="u")]
    facts = [NodeFacts(iface="eth0", user="1001:1001", login="bob"), NodeFacts(iface="eth0", user="1001:1001",
                                                                              login="bob")]
    cfg = UpConfig.of(ssh=SSHOptions(Path("h"), None, False), image="ddp-cifar:cpu", gpus=0)
    specs = job_specs(cfg, hosts, "10.0.0.1", facts)
    assert [s.name for s in specs] == ["cifar-node0-bob", "cifar-node1-bob"]
    assert specs[0].labels[labels.OWNER_UID_LABEL] == "1001" and specs[0].labels[labels.OWNER_LABEL] == "bob"
    assert labels.container_name("cifar", 0, "a b/c") == "cifar-node0-a_b_c"  # a Docker name allows no space or /


def test_kill_stops_only_the_callers_containers_and_names_the_other_owner() -> None:
    mine, legacy = _Container("cifar-node0-alice", "cifar", ALICE), _Container("cifar-node1", "cifar", None, 1)
    bobs = _Container("cifar-node0-bob", "cifar", BOB)
    res = jobs.kill_on_host(_Client([mine, legacy, bobs]), "cifar", 5, "h0", ALICE)
    assert mine.removed and legacy.removed and not bobs.stopped and not bobs.removed
    assert res.others == "job 'cifar' here belongs to bob (uid 1001), not to you: left alone"


def test_a_kill_that_finds_only_another_owners_job_is_refused_with_one_line() -> None:
    bobs = _Container("cifar-node0-bob", "cifar", BOB)
    res = jobs.kill_on_host(_Client([bobs]), "cifar", 5, "h0", ALICE)
    assert not bobs.stopped and not bobs.removed and res.exit_codes == {}
    with pytest.raises(JobError, match=r"^nothing stopped: job 'cifar' here belongs to bob \(uid 1001\)"):
        jobs.refuse_others([res], "cifar")
    jobs.refuse_others([res, jobs.KillResult("h1", ["x"], {"x": 0})], "cifar")  # something of mine stopped: fine


def test_status_all_lists_every_owners_jobs_with_nodes_gpus_and_age() -> None:
    now = datetime(2026, 11, 24, 12, 0, 0, tzinfo=timezone.utc)

    def attrs(created: str, ids: list[str] | None = None) -> dict[str, Any]:
        request = {"Count": 0 if ids else -1, "DeviceIDs": ids}
        return {"Created": created, "HostConfig": {"DeviceRequests": [request]}}

    found = [("h1", _Container("cifar-node1-bob", "cifar", BOB, 1, attrs=attrs("2026-11-24T11:00:00Z", ["2", "3"]))),
             ("h0", _Container("cifar-node0-bob", "cifar", BOB, 0, attrs=attrs("2026-11-24T10:58:30.1234Z", ["0"]))),
             ("h0", _Container("cifar-node0-alice", "cifar", ALICE, 0, "exited", attrs("2026-11-24T11:59:50Z"))),
             ("h0", _Container("old-node0", "old", None, 0, attrs={"Created": "2026-11-21T11:00:00Z"}))]
    rows = owner.job_rows(found, now)
    assert [(r.owner, r.job, r.nodes, r.gpus, r.age, r.running, r.containers) for r in rows] == [
        ("alice (uid 1000)", "cifar", "h0", "all", "0m10s", 0, 1),
        ("an older version (no owner label)", "old", "h0", "-", "3d01h", 1, 1),
        ("bob (uid 1001)", "cifar", "h0 h1", "0 2,3", "1h01m", 2, 2),
    ]


def test_status_all_prints_the_table() -> None:
    class _Nodes:
        hosts = [Host(name="h0", hostname="10.0.0.1", port=22, user="u")]

        def reachable(self) -> list[int]:
            return [0]

        def docker(self, rank: int) -> _Client:
            return _Client([_Container("cifar-node0-bob", "cifar", BOB), _Container("x-node0", "x", ALICE)])

    out = io.StringIO()
    assert print_all_jobs(DockerSSH(), _Nodes(), Console(file=out, width=200), {})  # type: ignore[arg-type]
    assert "bob (uid 1001)" in out.getvalue() and "alice (uid 1000)" in out.getvalue()


def test_the_gpu_probe_and_the_self_test_containers_carry_the_owner_and_a_name_per_login() -> None:
    """The short containers of `up`'s GPU probe and of `check`'s self-test belong to the job's owner (status --all
    shows whose they are) and are named after the login, so two people checking the same hosts do not clash."""
    from orchestrate.plan import shortlived

    hosts = [Host(name="h0", hostname="h0", port=22, user="alice")]
    config = UpConfig.of(ssh=SSHOptions(Path("x"), None, False), gpus=1)
    [spec] = job_specs(config, hosts, "h0", [NodeFacts("eth0", user="1000:1000", login="alice")])
    assert shortlived.probe_labels(spec) == {**labels.owner_labels("1000:1000", "alice"), JOB_LABEL: "cifar-gpuprobe"}
    [test] = shortlived.selftest([spec], config.program, config.resources, ("torchrun",))
    assert test.name == "cifar-selftest-node0-alice" and test.labels[labels.OWNER_UID_LABEL] == "1000"
