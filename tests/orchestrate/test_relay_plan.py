"""--relay: which node relays the image layers, who gets them from where, and auto's threshold (plan/relay.py),
as the dry run shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kit.units import SSH, job_plan

from orchestrate.backends.docker_ssh.request import plan_json, render_job_plan
from orchestrate.config import RELAY_AUTO_FROM, RELAY_FAN_OUT, UpConfig
from orchestrate.errors import ConfigError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt
from orchestrate.plan.relay import RelayPlan, plan_relay, relay_used
from orchestrate.probe.observations import LocalImage, NodeFacts

HOSTS = [Host(name=f"h{i}", hostname=f"10.0.0.{i + 1}", port=22, user="u", slots=None) for i in range(4)]
LOCAL = LocalImage("sha256:new", tuple(f"sha256:{i}" for i in range(5)), sizes=(100, 200, 300, 400, 500))
DIRS = {"data": "/home/u/.cache/ddp-cifar/data", "ckpt": "/home/u/ck", "log": "/home/u/logs"}


def test_auto_relays_from_the_threshold_on_forces_it_off_never() -> None:
    assert RELAY_AUTO_FROM == 3
    assert [relay_used("auto", n) for n in (1, 2, 3, 16)] == [False, False, True, True]
    assert [relay_used("on", n) for n in (1, 2, 3)] == [False, True, True]  # one node: nobody to relay to
    assert [relay_used("off", n) for n in (2, 3, 16)] == [False, False, False]


def test_the_first_node_that_lacks_layers_relays_one_archive_for_the_one_that_holds_the_fewest() -> None:
    # node 0 holds the image: node 1 relays; node 3 holds 2 layers, the others 4: the archive leaves out 2
    assert plan_relay("auto", {1: 4, 2: 4, 3: 2}) == RelayPlan(1, (2, 3), 2, (1, 1))
    assert plan_relay("on", {0: 4, 1: 4}) == RelayPlan(0, (1,), 4, (0,))
    chosen = plan_relay("auto", {0: 4, 1: 4, 2: 4})
    assert [chosen.source(r) for r in range(3)] == ["here", "node 0", "node 0"]
    assert plan_relay("auto", {0: 4, 1: 4}) == RelayPlan(None) and plan_relay("off", {0: 1, 1: 1, 2: 1}).relay is None


@pytest.mark.parametrize(("nodes", "fan_out", "parents"), [
    (5, 4, [0, 0, 0, 0]),  # up to the fan-out: flat, the relay serves every node
    (6, 4, [0, 0, 0, 0, 1]),  # one more: the first node that fetched serves it
    (16, 4, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3),  # 16 hosts: two levels, nobody serves more than 4
    (8, 2, [0, 0, 1, 1, 2, 2, 3]),  # fan-out 2: a binary tree, three levels
    (7, 1, [0, 1, 2, 3, 4, 5]),  # fan-out 1: a chain
])
def test_past_the_fan_out_the_nodes_that_fetched_serve_the_next_breadth_first(nodes: int, fan_out: int,
                                                                              parents: list[int]) -> None:
    chosen = plan_relay("on", dict.fromkeys(range(nodes), 0), fan_out)
    assert chosen.relay == 0 and chosen.fetch == tuple(range(1, nodes)) and list(chosen.parents) == parents
    assert max(len(chosen.children(r)) for r in range(nodes)) <= fan_out
    assert [chosen.source(r) for r in (0, nodes - 1)] == ["here", f"node {parents[-1]}"]


def test_the_tree_follows_the_ranks_that_fetch_and_a_node_knows_its_ancestors() -> None:
    # node 0 holds the image: node 2 relays; the tree is over the fetching ranks, skipping node 0
    chosen = plan_relay("on", dict.fromkeys((2, 3, 5, 7, 8, 9), 1), 2)
    assert chosen.relay == 2 and chosen.parents == (2, 2, 3, 3, 5)
    assert chosen.ancestors(9) == (5, 2) and chosen.ancestors(3) == (2,) and chosen.ancestors(2) == ()
    assert chosen.children(3) == (7, 8) and chosen.children(9) == () and chosen.parent(0) is None


def test_the_default_fan_out_at_sixteen_hosts_is_two_levels() -> None:
    assert RELAY_FAN_OUT == 4
    chosen = plan_relay("auto", dict.fromkeys(range(16), 0))
    assert max(len(chosen.ancestors(r)) for r in range(16)) == 2


def _plan(relay: str, images: list[str | None]):  # type: ignore[no-untyped-def]
    config = UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, relay=relay)  # type: ignore[arg-type]
    facts = [NodeFacts(iface="eth0", addr=f"10.0.0.{i + 1}", dirs=DIRS, image_id=image, layers_held=4)
             for i, image in enumerate(images)]
    return job_plan(config, Attempt(0), HOSTS[:len(images)], "10.0.0.1", facts, LOCAL, ("torchrun",))


def test_the_dry_run_says_who_gets_the_layers_from_where() -> None:
    plan = _plan("auto", [None, None, "sha256:new", None])
    text = render_job_plan(plan)
    assert ("# image layers: sent once from here to node 0, which serves them to node(s) 1, 3 for the transfer's "
            "time (--relay auto)") in text
    assert "#   image: send 1 of 5 layers, 0.0 MB uncompressed, from here" in text
    assert text.count("#   image: send 1 of 5 layers, 0.0 MB uncompressed, from node 0") == 2
    assert "#   image: present, nothing sent\n" in text
    froms = [n["image"]["from"] for n in json.loads(json.dumps(plan_json(plan)))["nodes"]]
    assert froms == ["here", "node 0", None, "node 0"]
    off = render_job_plan(_plan("off", [None, None, None]))
    assert "# image layers" not in off and off.count("uncompressed, from here") == 3


def test_past_the_fan_out_the_dry_run_says_each_node_fetches_from_its_parent() -> None:
    hosts = [Host(name=f"h{i}", hostname=f"10.0.1.{i + 1}", port=22, user="u", slots=None) for i in range(7)]
    config = UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, relay="auto")  # type: ignore[arg-type]
    facts = [NodeFacts(iface="eth0", addr=f"10.0.1.{i + 1}", dirs=DIRS, image_id=None, layers_held=4)
             for i in range(7)]
    plan = job_plan(config, Attempt(0), hosts, "10.0.1.1", facts, LOCAL, ("torchrun",))
    assert ("# image layers: sent once from here to node 0, which serves them to node(s) 1, 2, 3, 4; each node that "
            "fetched serves up to 4 more (a relay tree: each node's line says from which node)") in render_job_plan(plan)
    assert [n["image"]["from"] for n in plan_json(plan)["nodes"]] == ["here"] + ["node 0"] * 4 + ["node 1"] * 2


def test_the_dry_run_says_who_gets_the_data_from_where(tmp_path: Path) -> None:
    def plan(relay: str, nodes: int):  # type: ignore[no-untyped-def]
        config = UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, relay=relay,  # type: ignore[arg-type]
                             data_from=tmp_path, entry="-m x")
        facts = [NodeFacts(iface="eth0", addr=f"10.0.0.{i + 1}", dirs=DIRS, image_id=LOCAL.id, layers_held=5)
                 for i in range(nodes)]
        return job_plan(config, Attempt(0), HOSTS[:nodes], "10.0.0.1", facts, LOCAL, ("torchrun",))

    text = render_job_plan(plan("auto", 3))
    assert ("# data (--data-from): what the nodes lack sent once from here to node 0, which serves it to "
            "node(s) 1, 2 for the transfer's time (--relay auto)") in text
    assert text.count(f"#   data: {tmp_path} synced, from node 0") == 2
    assert text.count(f"#   data: {tmp_path} synced, from here") == 1
    assert [n["data"]["from"] for n in plan_json(plan("auto", 3))["nodes"]] == ["here", "node 0", "node 0"]
    two = render_job_plan(plan("auto", 2))  # under auto's threshold: each node is sent its files from here
    assert "# data (--data-from)" not in two and two.count("synced, from here") == 2
    assert render_job_plan(plan("on", 2)).count("synced, from node 0") == 1


def test_an_unknown_relay_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="--relay"):
        UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, relay="always")  # type: ignore[arg-type]
