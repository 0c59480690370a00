"""The claim check (apply/claim.py) on a fake daemon: two `up`s read the same labels at preflight; the one whose
containers were created later sees the other's, removes its own, and plans again on fresh labels. Fakes only
here; tests/cluster/test_gpu_sets.py starts real `up`s at the same moment on real daemons."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import docker.errors
import pytest
from rich.console import Console

from orchestrate.apply import claim
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import NodeFacts, build_plan

HOST = Host(name="gpu1", hostname="10.0.0.11", port=22, user="u", slots=None)
_CLOCK = itertools.count(1)


class FakeContainer:
    def __init__(self, daemon: FakeDaemon, labels: dict[str, str], status: str = "created") -> None:
        self.daemon, self.labels, self.status = daemon, labels, status
        self.id = f"{next(_CLOCK):064x}"
        self.attrs = {"Created": f"2026-11-24T08:00:{int(self.id, 16):02d}.1Z"}  # later ones: later times

    def reload(self) -> None:
        pass

    def start(self) -> None:
        self.status = "running"

    def remove(self, force: bool = False) -> None:
        self.daemon.all.remove(self)


class FakeDaemon:
    """containers.create / list / get as docker-py's, over a list. `vanishing`:
    containers listed, then gone when read (another `up` removed them in between)."""

    def __init__(self) -> None:
        self.all: list[FakeContainer] = []
        self.containers = self
        self.vanishing: list[FakeContainer] = []

    def create(self, **kwargs: Any) -> FakeContainer:
        made = FakeContainer(self, dict(kwargs["labels"]))
        self.all.append(made)
        return made

    def containers_listed(self, label: str) -> list[FakeContainer]:
        return [c for c in [*self.all, *self.vanishing] if label in c.labels]

    def get(self, cid: str) -> FakeContainer:
        found = [c for c in self.all if c.id == cid]
        if not found:
            raise docker.errors.NotFound(f"No such container: {cid}")
        return found[0]

    def list(self, all: bool, filters: dict[str, str], ignore_removed: bool = False) -> list[FakeContainer]:
        found = []
        for c in self.containers_listed(filters["label"]):  # docker-py reads each listed container again
            try:
                found.append(self.get(c.id))
            except docker.errors.NotFound:
                if not ignore_removed:
                    raise
        return found


def test_the_later_creator_removes_its_containers_and_takes_free_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = FakeDaemon()
    # Bob's `up` created its containers first (not started yet) on GPUs 0,1 and port 29500.
    bobs = daemon.create(labels={"ddp-cifar.job": "cifar", "ddp-cifar.owner": "bob", "ddp-cifar.owner-uid": "1001",
                                 "ddp-cifar.gpus": "0,1", "ddp-cifar.master-port": "29500"})
    nodes = SimpleNamespace(docker=lambda r, timeout=60.0: daemon, hosts=[HOST])
    waits: list[float] = []
    monkeypatch.setattr(claim.time, "sleep", waits.append)
    config = UpConfig(ssh=SSHOptions(Path("h"), None, False), job="cifar", gpus=2, gpus_on_cpu=True)
    facts = [NodeFacts("eth0", 4, user="1000:1000", login="ann", gpu_set=(0, 1))]  # what preflight read: all free
    stale = build_plan(dataclasses.replace(config, master_port=29500), [HOST], "10.0.0.11", facts)

    def replan(port: int | None, new: Any) -> list[Any]:
        return build_plan(dataclasses.replace(config, master_port=port), [HOST], "10.0.0.11", new)

    got = claim.start_claimed(nodes, config, stale, facts, [(0, 1, 2, 3)], {22}, replan,  # type: ignore[arg-type]
                              Console(file=None, quiet=True))
    (mine,) = got.containers
    assert mine.status == "running" and mine.labels["ddp-cifar.gpus"] == "2,3"
    assert mine.labels["ddp-cifar.master-port"] == "29501" and got.port == 29501
    assert daemon.all == [bobs, mine]  # the first, overlapping containers were removed
    assert got.tries == 2 and got.lost == ["gpu1: bob/cifar created first"] and len(waits) == 1
    assert claim.BACKOFF_S[0] <= waits[0] <= claim.BACKOFF_S[1] and got.waited_s == waits[0]


def test_a_container_removed_between_the_listing_and_its_read_holds_nothing() -> None:
    """Another `up` that lost its claim removes its containers while this one reads the labels: the listed but gone
    container is passed over, not a failed claim check (CI saw `claim check failed ... 404 No such container`,
    from docker-py's containers.list(), which reads each listed container again)."""
    from orchestrate.probe.holdings import read_holdings

    daemon = FakeDaemon()
    bobs = daemon.create(labels={"ddp-cifar.job": "cifar", "ddp-cifar.owner": "bob", "ddp-cifar.owner-uid": "1001",
                                 "ddp-cifar.gpus": "0,1", "ddp-cifar.master-port": "29500"})
    daemon.vanishing.append(FakeContainer(daemon, {"ddp-cifar.job": "x", "ddp-cifar.owner": "cy",
                                                   "ddp-cifar.owner-uid": "1002", "ddp-cifar.gpus": "2,3"}))
    found = read_holdings(daemon, "mine", 1000)
    assert [h.gpus for h in found.others] == [(0, 1)] and found.others[0].who == "bob/cifar"
    assert bobs in daemon.all
