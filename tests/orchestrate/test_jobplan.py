"""The JobPlan is plain data: decided from facts before anything is applied, and printed as it is applied."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from kit.units import SSH, job_plan, job_specs

from orchestrate import cli
from orchestrate.backends.docker_ssh.request import plan_json, render_job_plan
from orchestrate.config import Data, UpConfig
from orchestrate.errors import ConfigError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt, data_action, image_action, launch_head
from orchestrate.probe.observations import CheckResult, Launcher, LocalBase, LocalImage, NodeFacts

HOSTS = [Host(name=f"h{i}", hostname=f"10.0.0.{i + 1}", port=22, user="u", slots=None) for i in range(2)]
LOCAL = LocalImage("sha256:new", tuple(f"sha256:{i}" for i in range(5)), sizes=(100, 200, 300, 400, 500))
DIRS = {"data": "/home/u/.cache/ddp-cifar/data", "ckpt": "/home/u/ck", "log": "/home/u/logs"}


def config(**kw: object) -> UpConfig:
    return UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, **kw)  # type: ignore[arg-type]


def _data_of(c: UpConfig) -> tuple[Data, bool]:
    """data_action's first two arguments: the data section, and whether the program is the trainer."""
    return c.data, c.program.is_trainer


def test_the_image_action_is_decided_from_the_layers_the_node_holds() -> None:
    assert image_action(config().delivery, LOCAL, NodeFacts(image_id="sha256:new")).kind == "present"
    missing = image_action(config().delivery, LOCAL, NodeFacts(image_id=None, layers_held=3))
    assert (missing.kind, missing.layers_sent, missing.layers, missing.bytes) == ("send", 2, 5, 900)
    unknown_sizes = image_action(config().delivery, LocalImage("sha256:new", LOCAL.diff_ids, None), NodeFacts(image_id="sha256:old"))
    assert (unknown_sizes.layers_sent, unknown_sizes.bytes) == (5, None)
    pull = config(pull=True)
    assert image_action(pull.delivery, None, NodeFacts(image_id=None)).kind == "pull"
    assert image_action(pull.delivery, None, NodeFacts(image_id="sha256:any")).kind == "present"
    assert image_action(pull.delivery, LOCAL, NodeFacts(image_id="sha256:old")).kind == "pull"  # differs from the local one
    assert image_action(pull.delivery, LOCAL, NodeFacts(image_id="sha256:old")).layers_sent == 0


BASE = LocalBase("reg.example:5000/pytorch:26.08", 3, "reg.example:5000/pytorch@sha256:b")
ON_BASE = LocalImage("sha256:new", LOCAL.diff_ids, LOCAL.sizes, BASE)


def test_a_node_that_lacks_the_base_and_reaches_its_registry_pulls_it_and_gets_only_the_layers_above() -> None:
    pulls = image_action(config().delivery, ON_BASE, NodeFacts(layers_held=1, base_reach=""))
    assert (pulls.pull_base, pulls.base_layers, pulls.layers_sent, pulls.bytes) == (BASE.ref, 3, 2, 900)
    assert pulls.base_why == ""
    cut_off = image_action(config().delivery, ON_BASE, NodeFacts(layers_held=0, base_reach="no route to host"))
    assert (cut_off.pull_base, cut_off.layers_sent, cut_off.bytes, cut_off.base_why) == ("", 5, 1500, "no route to host")
    holds_base = image_action(config().delivery, ON_BASE, NodeFacts(layers_held=4))  # nothing asked, nothing to say
    assert (holds_base.pull_base, holds_base.base_why, holds_base.layers_sent) == ("", "", 1)
    no_digest = LocalImage("sha256:new", LOCAL.diff_ids, LOCAL.sizes, LocalBase(BASE.name, 3, BASE.name, "no digest"))
    local_reason = image_action(config().delivery, no_digest, NodeFacts(layers_held=0))
    assert (local_reason.pull_base, local_reason.base_why, local_reason.layers_sent) == ("", "no digest", 5)
    # the base's layers unknown here: only a node that holds none of the image's surely lacks it
    unknown = LocalImage("sha256:new", LOCAL.diff_ids, LOCAL.sizes, LocalBase(BASE.name, 0, BASE.name, "not here"))
    assert image_action(config().delivery, unknown, NodeFacts(layers_held=0)).base_why == "not here"
    assert image_action(config().delivery, unknown, NodeFacts(layers_held=2)).base_why == ""
    assert image_action(config(pull=True).delivery, ON_BASE, NodeFacts(base_reach="")).kind == "pull"  # --pull: the image


def test_the_plan_shows_per_node_whether_the_base_is_pulled_there(tmp_path: Path) -> None:
    facts = [NodeFacts(iface="eth0", addr="10.0.0.1", dirs=DIRS, base_reach=""),
             NodeFacts(iface="eth0", addr="10.0.0.2", dirs=DIRS, base_reach="connection refused")]
    plan = job_plan(config(), Attempt(0), HOSTS, "10.0.0.1", facts, ON_BASE, ("torchrun",))
    text = render_job_plan(plan)
    assert (f"#   image: pull base {BASE.ref} on the node (its 3 layers), then send 2 of 5 layers, "
            "0.0 MB uncompressed") in text
    assert "#   image: send 5 of 5 layers, 0.0 MB uncompressed (base not pulled by the node: connection refused)" in text
    images = [n["image"] for n in json.loads(json.dumps(plan_json(plan)))["nodes"]]
    assert [(i["pull_base"], i["layers_sent"], i["base_why"]) for i in images] == [
        (BASE.ref, 2, ""), ("", 5, "connection refused")]


def test_the_data_action_follows_the_config_and_the_verified_copy(tmp_path: Path) -> None:
    assert data_action(*_data_of(config()), NodeFacts(), None, False).kind == "download"
    assert data_action(*_data_of(config()), NodeFacts(data_present=True), None, False).kind == "present"
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(b"x")
    sent = data_action(*_data_of(config(data_from=archive, data_md5=hashlib.md5(b"x").hexdigest())), NodeFacts(), 1,
                       False)
    assert (sent.kind, sent.source, sent.bytes) == ("send", str(archive), 1)
    assert data_action(*_data_of(config(data_from=tmp_path)), NodeFacts(), None, True).kind == "sync"
    assert data_action(*_data_of(config(entry="/app/t.py")), NodeFacts(), None, False).kind == "none"


def _facts(**kw: object) -> list[NodeFacts]:
    return [NodeFacts(iface="eth0", addr=f"10.0.0.{i + 1}", dirs=DIRS, **kw) for i in range(2)]  # type: ignore[arg-type]


SSH_OK = [(CheckResult("ssh", True, "u@h"),)] * 2  # preflight's verdicts on each node


def test_the_plan_uses_the_probed_folders_and_says_the_attempt() -> None:
    attempt = Attempt(1, "node 1 (h1) exited with code 1", resume=True)
    plan = job_plan(config(), attempt, HOSTS, "10.0.0.1", _facts(leftovers=("p-node0",)), LOCAL, ("torchrun",), SSH_OK)
    node = plan.nodes[0]
    assert node.dirs == DIRS and [m.source for m in node.container.mounts] == list(DIRS.values())
    assert node.leftovers == ("p-node0",) and node.image.kind == "send"
    assert node.container.env["DDP_RESTART"] == "1" and "--resume" in node.container.command
    data = json.loads(json.dumps(plan_json(plan)))  # JSON as printed
    assert data["attempt"] == {"number": 1, "cause": "node 1 (h1) exited with code 1", "resume": True}
    assert data["nodes"][1]["container"]["command"] == list(plan.nodes[1].container.command)
    assert data["nodes"][0]["image"]["layers_sent"] == 5 and data["nodes"][0]["leftovers"] == ["p-node0"]
    text = render_job_plan(plan)
    assert "#   image: send 5 of 5 layers, 0.0 MB uncompressed" in text and "leftovers removed: p-node0" in text
    assert "#   checks: ssh ok (u@h)" in text and data["nodes"][0]["checks"][0]["text"] == "u@h"


def test_a_launcher_found_after_a_pull_changes_only_the_commands_head() -> None:
    plan = job_plan(config(pull=True), Attempt(), HOSTS, "10.0.0.1", _facts(), None, None)
    assert plan.launcher is None and plan.nodes[0].container.command[0] == "torchrun"
    launcher = Launcher(("/usr/bin/python3", "-m", "torch.distributed.run"))
    found = plan.with_launcher(launcher)
    for before, after in zip(plan.nodes, found.nodes, strict=True):
        assert after.container.command == ("/usr/bin/python3", "-m", "torch.distributed.run",
                                           *before.container.command[1:])
    assert found.launcher == launcher and found.head == launcher.torchrun
    # An image with trainer.launch, every node one process: that launcher, with the same options.
    light = found.with_launcher(Launcher(("torchrun",), ("/usr/bin/python3", "-m", "trainer.launch")))
    assert [n.container.command for n in light.nodes] == \
        [("/usr/bin/python3", "-m", "trainer.launch", *n.container.command[1:]) for n in plan.nodes]


ONE_PROCESS = ("/usr/bin/python3", "-m", "trainer.launch")


@pytest.mark.parametrize(("launcher", "nprocs", "head"), [
    (Launcher(("torchrun",), ONE_PROCESS), [1, 1, 1], ONE_PROCESS),  # no agent where one process is all
    (Launcher(("torchrun",), ONE_PROCESS), [1, 2, 1], ("torchrun",)),  # uneven: torchrun's rendezvous numbers ranks
    (Launcher(("torchrun",), ONE_PROCESS), [2, 2], ("torchrun",)),
    (Launcher(("torchrun",), ONE_PROCESS), [1, "auto"], ("torchrun",)),  # a count not known yet
    (Launcher(("torchrun",), None), [1, 1], ("torchrun",)),  # an image without trainer.launch
    (None, [1, 1], ("torchrun",)),  # not checked yet (--pull)
])
def test_the_launcher_of_one_process_a_node_only_where_every_node_runs_one(
        launcher: Launcher | None, nprocs: list[int | str], head: tuple[str, ...]) -> None:
    assert launch_head(launcher, nprocs) == head


def test_a_cpu_job_of_one_process_a_node_starts_without_torchrun() -> None:
    light = Launcher(("torchrun",), ONE_PROCESS)
    one = job_specs(config(), HOSTS, "10.0.0.1", launcher=light)
    assert [s.command[:4] for s in one] == [(*ONE_PROCESS, "--nnodes")] * 2
    two = job_specs(config(), [dataclasses.replace(h, slots=2) for h in HOSTS], "10.0.0.1", launcher=light)
    assert [s.command[:2] for s in two] == [("torchrun", "--nnodes")] * 2


def test_json_is_refused_without_a_dry_run_and_the_offline_form_has_the_containers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--json prints a dry run's plan"):
        config(as_json=True)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node-a\nnode-b\n")
    assert cli.main(["up", "--hosts", str(hosts), "--gpus", "0", "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["form"] == "offline" and [n["host"] for n in data["nodes"]] == ["node-a", "node-b"]
    node1 = data["nodes"][1]
    assert node1["container"]["command"][:5] == ["torchrun", "--nnodes", "2", "--node_rank", "1"]
    assert node1["docker_run"][:2] == ["docker", "run"] and "dirs" not in node1  # nothing probed


@pytest.mark.parametrize(("args", "refused"), [
    (("--strategy", "fsdp"), True),
    (("--strategy=fsdp", "--epochs", "3"), True),
    (("--strategy", "fsdp", "--strategy", "ddp"), False),  # the last one wins, as in the trainer's parser
    (("--epochs", "3"), False),                              # DDP runs any mix of process counts
])
def test_fsdp_on_nodes_with_different_process_counts_is_refused_in_one_line(args: tuple[str, ...],
                                                                             refused: bool) -> None:
    """An 8-slot and a 4-slot host (a hosts file's slots=): the trainer would agree on flat FSDP, every all-gather
    across nodes; the plan says so before anything starts."""
    hosts = [Host(name="a", hostname="10.0.0.1", port=22, user="u", slots=8),
             Host(name="b", hostname="10.0.0.2", port=22, user="u", slots=4)]
    c = config(trainer_args=args)
    if not refused:
        job_specs(c, hosts, "10.0.0.1", attempt=Attempt())
        return
    with pytest.raises(ConfigError) as e:
        job_specs(c, hosts, "10.0.0.1", attempt=Attempt())
    assert str(e.value).startswith("--strategy fsdp needs the same number of processes on every node, and these "
                                   "differ (a: 8, b: 4)")
