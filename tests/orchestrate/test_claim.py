"""The claim's label reading (backends/docker_ssh/observe.py, probe/holdings.py) against docker-py's listing, on a fake daemon: the one case the
real daemons of tests/cluster/test_gpu_sets.py cannot force, a container removed between docker-py's listing and
its read of that container. The race itself (two `up`s, the later creator plans again or is refused) is forced
there with a gate, on real daemons."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import docker.errors

from orchestrate.backends.docker_ssh.observe import created_claim, read_holdings


class FakeContainer:
    def __init__(self, cid: str, labels: dict[str, str], status: str = "created") -> None:
        self.id, self.labels, self.status = cid, labels, status
        self.attrs = {"Created": f"2026-11-24T08:00:0{cid}.1Z"}

    def reload(self) -> None:
        pass


class FakeDaemon:
    """containers.list as docker-py's: it lists, then reads each listed container again; `vanishing` are listed,
    then gone when read (another `up` removed them in between)."""

    def __init__(self, present: list[FakeContainer], vanishing: list[FakeContainer]) -> None:
        self.present, self.vanishing, self.containers = present, vanishing, self
        self.reads: list[str] = []  # the containers read whole, one request each

    def get(self, cid: str) -> FakeContainer:
        self.reads.append(cid)
        found = [c for c in self.present if c.id == cid]
        if not found:
            raise docker.errors.NotFound(f"No such container: {cid}")
        return found[0]

    def list(self, all: bool, filters: dict[str, str], ignore_removed: bool = False,
             sparse: bool = False) -> list[Any]:
        label = filters["label"]
        listed = [c for c in [*self.present, *self.vanishing] if label in c.labels]
        if sparse:  # the listing's own summaries: no read of each container
            return [SimpleNamespace(id=c.id, attrs={"Id": c.id, "Labels": c.labels, "State": c.status})
                    for c in listed]
        found = []
        for c in listed:
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


def test_exited_containers_of_other_jobs_are_not_read_one_by_one() -> None:
    """Each job a node ran leaves an exited container with a port label: the claim reads only the containers that
    can hold something (another job's running or created one) and none of the exited ones, the caller's own
    counted by their labels. docker-py's full listing read each again: 3 requests per old job per node per `up`."""
    def labelled(cid: str, job: str, status: str, uid: str = "1001") -> FakeContainer:
        return FakeContainer(cid, {"ddp-cifar.job": job, "ddp-cifar.owner": "bob", "ddp-cifar.owner-uid": uid,
                                   "ddp-cifar.master-port": f"2950{cid}"}, status)

    old = [labelled(str(i), f"old{i}", "exited") for i in range(5)]
    running = labelled("7", "other", "running")
    own = labelled("8", "mine", "exited", uid="1000")
    daemon = FakeDaemon([*old, running, own], [])
    found = read_holdings(daemon, "mine", 1000)
    assert [(h.who, h.port, h.created) for h in found.others] == [("bob/other", 29507, "2026-11-24T08:00:07.1Z")]
    assert found.own_port == 29508
    assert daemon.reads == ["7"]


def test_the_claim_of_a_container_just_created_is_read_from_the_create_itself() -> None:
    """docker-py's create reads the new container back: the claim check takes its creation time from that read,
    with no request of its own per node between the creates and the starts."""
    made = FakeContainer("3", {"ddp-cifar.job": "mine", "ddp-cifar.owner": "al", "ddp-cifar.master-port": "29503"})

    def read_again() -> None:
        raise AssertionError("read again")

    made.reload = read_again  # type: ignore[method-assign]
    claim = created_claim(made)
    assert claim is not None and (claim.port, claim.created) == (29503, "2026-11-24T08:00:03.1Z")
