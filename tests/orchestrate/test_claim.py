"""The claim's label reading (backends/docker_ssh/observe.py, probe/holdings.py) against docker-py's listing, on a fake daemon: the one case the
real daemons of tests/cluster/test_gpu_sets.py cannot force, a container removed between docker-py's listing and
its read of that container. The race itself (two `up`s, the later creator plans again or is refused) is forced
there with a gate, on real daemons."""

from __future__ import annotations

import docker.errors

from orchestrate.backends.docker_ssh.observe import read_holdings


class FakeContainer:
    def __init__(self, cid: str, labels: dict[str, str]) -> None:
        self.id, self.labels, self.status = cid, labels, "created"
        self.attrs = {"Created": f"2026-11-24T08:00:0{cid}.1Z"}

    def reload(self) -> None:
        pass


class FakeDaemon:
    """containers.list as docker-py's: it lists, then reads each listed container again; `vanishing` are listed,
    then gone when read (another `up` removed them in between)."""

    def __init__(self, present: list[FakeContainer], vanishing: list[FakeContainer]) -> None:
        self.present, self.vanishing, self.containers = present, vanishing, self

    def get(self, cid: str) -> FakeContainer:
        found = [c for c in self.present if c.id == cid]
        if not found:
            raise docker.errors.NotFound(f"No such container: {cid}")
        return found[0]

    def list(self, all: bool, filters: dict[str, str], ignore_removed: bool = False) -> list[FakeContainer]:
        found = []
        for c in [*self.present, *self.vanishing]:
            try:
                found.append(self.get(c.id))
            except docker.errors.NotFound:
                if not ignore_removed:
                    raise
        return found


def test_a_container_removed_between_the_listing_and_its_read_holds_nothing() -> None:
    """Another `up` that lost its claim removes its containers while this one reads the labels: the listed but gone
    container is passed over, not a failed claim check (CI saw `claim check failed ... 404 No such container`,
    from docker-py's containers.list(), which reads each listed container again)."""
    bobs = FakeContainer("1", {"ddp-cifar.job": "cifar", "ddp-cifar.owner": "bob", "ddp-cifar.owner-uid": "1001",
                               "ddp-cifar.gpus": "0,1", "ddp-cifar.master-port": "29500"})
    gone = FakeContainer("2", {"ddp-cifar.job": "x", "ddp-cifar.owner": "cy", "ddp-cifar.owner-uid": "1002",
                               "ddp-cifar.gpus": "2,3"})
    found = read_holdings(FakeDaemon([bobs], [gone]), "mine", 1000)
    assert [h.gpus for h in found.others] == [(0, 1)] and found.others[0].who == "bob/cifar"
