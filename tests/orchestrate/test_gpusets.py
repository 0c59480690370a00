"""GPU sets and master ports on shared hosts (docs/shared-hosts.md): the allocation, who yields when two `up`s
claim at once, the port choice, and the exact Docker arguments and labels. Pure decisions; the cluster test
tests/cluster/test_gpu_sets.py runs them on real daemons. Only a GPU node shows Docker's device_ids at work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from kit.units import HOSTS, gpu_facts, gpus_judged, job_plan, job_specs, parse

from devcluster import cluster as devcluster_cluster
from orchestrate import cli
from orchestrate.backends.docker_ssh.owner import gpus_of
from orchestrate.backends.docker_ssh.request import docker_run_argv, plan_json, render_job_plan, sdk_kwargs
from orchestrate.errors import ConfigError
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.plan import gpuset, ports
from orchestrate.plan.gpuset import GpuSet, allocate, decide_gpus, yields_to
from orchestrate.plan.jobplan import Attempt
from orchestrate.plan.verdicts import judge_port
from orchestrate.probe.observations import GpuSeen, Held, Holdings, held

FOUR = (0, 1, 2, 3)
BOB = Held("b1", "bob/cifar", (0, 1), 29500, "2026-11-24T08:00:00.5Z")
CAROL = Held("c1", "carol/r18", (2,), None, "2026-11-24T08:00:01Z")
GPU_LIST = "\n".join(f"{i}, GPU-0000000{i}-0000-4000-8000-00000000000{i}" for i in range(4))


def test_a_count_takes_free_gpus_and_a_restart_keeps_its_own() -> None:
    assert allocate(2, (), FOUR, [BOB]).gpus == (2, 3)
    assert allocate(1, (), FOUR, [BOB, CAROL]).gpus == (3,)
    assert allocate(2, (), FOUR, [], keep=(3, 1)).gpus == (3, 1)  # its own set while free
    assert allocate(2, (), FOUR, [CAROL], keep=(2, 3)).gpus == (3, 0)  # GPU 2 was taken meanwhile


def test_not_enough_free_all_and_held_indices_are_one_line_naming_the_holders() -> None:
    third = allocate(2, (), FOUR, [BOB, Held("d1", "ddp2/cifar", (2, 3), None, "t")])
    assert third.gpus == () and third.problem == ("--gpus 2: 0 of 4 GPU(s) free here, held by bob/cifar (GPU 0,1), "
                                                  "ddp2/cifar (GPU 2,3); ask for fewer or wait until they are free")
    every = allocate(GPUS_ALL, (), FOUR, [CAROL])
    assert every.problem is not None and every.problem.startswith("--gpus all: held by carol/r18 (GPU 2);")
    assert allocate(GPUS_ALL, (), FOUR, []).gpus == FOUR
    by_hand = allocate(2, (1, 2), FOUR, [BOB])
    assert by_hand.problem is not None and by_hand.problem.startswith("--gpus 1,2: held by bob/cifar (GPU 1);")
    assert allocate(2, (2, 3), FOUR, [BOB]).gpus == (2, 3)


def test_only_containers_that_still_run_hold_gpus() -> None:
    labels = {"ddp-cifar.gpus": "0,1", "ddp-cifar.owner": "bob", "ddp-cifar.job": "cifar"}
    assert held("x", labels, "exited", "t") is None
    claim = held("x", labels, "created", "t")  # created, not started: another `up` is claiming right now
    assert claim is not None and claim.gpus == (0, 1) and claim.who == "bob/cifar" and claim.port is None


def test_the_later_creator_yields_and_docker_trimmed_fractions_compare_right() -> None:
    """Docker writes RFC 3339 with trailing zeros trimmed: `.1Z` is earlier than `.12Z`, though it sorts last as
    text ('Z' > '2')."""
    early = Held("b", "bob/cifar", (0,), None, "2026-11-24T08:00:00.1Z")
    late = Held("a", "ann/cifar", (0, 1), None, "2026-11-24T08:00:00.12Z")
    assert yields_to(late, [early]) == [early] and yields_to(early, [late]) == []
    tie = Held("c", "cat/cifar", (1,), None, late.created)  # same instant: the smaller ID stands
    assert yields_to(tie, [late]) == [late] and yields_to(late, [tie]) == []
    elsewhere = Held("d", "dan/cifar", (3,), 29501, "2026-11-24T07:00:00Z")
    assert yields_to(late, [elsewhere]) == []
    same_port = Held("e", "eve/cifar", (), 29500, "2026-11-24T07:00:00Z")
    assert yields_to(Held("f", "fay/cifar", (), 29500, late.created), [same_port]) == [same_port]


def test_the_port_is_free_on_node_0_and_claimed_by_no_other_job() -> None:
    starting = Held("s", "bob/cifar", (), 29501, "t")  # labelled, its torchrun not listening yet
    assert ports.choose(None, {22, 29500}, [starting]) == (29502, "29502 (chosen: free)")
    assert ports.choose(None, set(), [], keep=29507)[0] == 29507  # a restart keeps its port
    assert ports.choose(None, {29507}, [], keep=29507)[0] == 29500
    taken = ports.choose(29501, set(), [starting])
    assert taken == (None, "master port 29501 is held by bob/cifar; pick another with --master-port or leave it out")
    assert ports.choose(29500, {29500}, [])[0] is None and ports.choose(29500, {29500}, [], replaced=True)[0] == 29500


def test_preflight_shows_the_set_and_the_holders_and_node_0_the_port() -> None:
    facts = {"smi": "ok", "gpus": "4", "gpu_list": GPU_LIST, "ss_ok": "1", "listening": "0.0.0.0:22 [::]:29500"}
    decided, cell = gpus_judged(facts, parse("--gpus", "2").resources, holdings=Holdings([BOB]))
    port = judge_port(facts, Holdings([BOB]), None)
    assert decided.ids == (2, 3) and decided.held and cell.text == "GPU 2,3 of 4; others: bob/cifar (GPU 0,1)"
    assert port.port == 29501 and port.check.text == "29501 (chosen: free)"  # 29500 listens, bob's label
    decided, cell = gpus_judged(facts, parse("--gpus", "all").resources, holdings=Holdings([BOB]))
    assert decided.refused and not cell.ok and cell.text == (
        "--gpus all: held by bob/cifar (GPU 0,1); ask for a count of free GPUs (--gpus N), or wait until they are free")


def test_the_granted_set_goes_to_docker_as_device_ids_with_labels_and_nproc() -> None:
    facts = [gpu_facts(4, (2, 3), iface="eth0", gpus=4, user="1000:1000", login="ann")] * 2
    n0, n1 = job_specs(parse("--gpus", "2", "--master-port", "29501"), HOSTS, "10.0.0.11", facts)
    (request,) = sdk_kwargs(n0)["device_requests"]
    assert request["DeviceIDs"] == ["2", "3"] and request["Count"] == 0  # never a count: Docker's would be 0,1
    assert n0.labels["ddp-cifar.gpus"] == "2,3" and n0.labels["ddp-cifar.master-port"] == "29501"
    assert "ddp-cifar.master-port" not in n1.labels
    assert n0.command[n0.command.index("--nproc_per_node") + 1] == "2"
    assert '--gpus="device=2,3"' in docker_run_argv(n0)
    assert "CUDA_VISIBLE_DEVICES" not in n0.env  # on a GPU node Docker sets NVIDIA_VISIBLE_DEVICES itself


def test_gpus_on_cpu_holds_the_set_and_passes_it_as_a_gpu_node_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """The devcluster's setting (its clients' environment), not an option: the hosts' GPUs are CPU stand-ins."""
    facts = [gpu_facts(4, (1, 3), iface="eth0", gpus=4, user="1000:1000", login="ann")] * 2
    assert not parse("--gpus", "2").resources.gpus_on_cpu
    monkeypatch.setenv(cli.GPUS_ON_CPU_ENV, "1")
    assert cli.GPUS_ON_CPU_ENV == devcluster_cluster.GPUS_ON_CPU_ENV  # the name the devcluster sets
    n0, _ = job_specs(parse("--gpus", "2", "--master-port", "29501"), HOSTS, "10.0.0.11", facts)
    assert sdk_kwargs(n0)["device_requests"] is None  # a CPU host's daemon has no GPU driver to ask
    assert n0.env["NVIDIA_VISIBLE_DEVICES"] == "1,3" and n0.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert n0.labels["ddp-cifar.gpus"] == "1,3" and "--device" not in n0.command
    assert n0.command[n0.command.index("--nproc_per_node") + 1] == "2"
    assert gpus_of({"Config": {"Labels": n0.labels}, "HostConfig": {}}) == "1,3"  # status --all shows it
    assert parse("--gpus", "0").resources.cpu_mode  # --gpus 0 on such hosts: plain CPU, as anywhere
    with pytest.raises(ConfigError, match="unrecognized arguments: --gpus-on-cpu"):  # no user's option
        parse("--gpus", "2", "--gpus-on-cpu")


def test_created_order_pads_the_fraction() -> None:
    assert gpuset.created_key(Held("i", "w", (), None, "2026-11-24T08:00:00.5Z"))[0] == "2026-11-24T08:00:00.500000000Z"


def test_devcluster_nvidia_smi_prints_the_formats_the_probe_reads(tmp_path: Path) -> None:
    """The simulated nvidia-smi, run for real: the probe's two queries parse as on a real node."""
    import shutil
    import subprocess

    from orchestrate.plan import gpus

    smi = tmp_path / "nvidia-smi"
    shutil.copy(Path(__file__).parents[2] / "devcluster" / "scripts" / "nvidia-smi", smi)
    (tmp_path / "gpus").write_text("4 1\n")
    listed = subprocess.run([str(smi), "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=True).stdout
    apps = subprocess.run([str(smi), "--query-compute-apps=gpu_uuid,pid,process_name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout
    assert gpus.gpu_indices(listed) == [0, 1, 2, 3] and apps == "" and gpus.busy_gpus(listed, apps) == {}
    assert listed.splitlines()[1] == "1, GPU-00000001-0000-4000-8000-000000000001"


def test_one_function_says_which_gpus_each_node_gets_and_why() -> None:
    """plan/gpuset.py's decide_gpus answers for every source of a GPU set: CPU, the offline dry run (the line's
    gpu_ids=, --gpus indices, a count), the probed node beside other jobs (a restart keeps its own set), a refusal;
    the plan carries the answer and --dry-run=hosts prints it."""
    line = Host(name="n1", hostname="10.0.0.12", port=22, user=None, slots=None, gpu_ids=(2, 3), source="hosts:2")
    plain = HOSTS[0]

    def decided(host: Host, *argv: str, seen: GpuSeen | None = None, holdings: Holdings | None = None) -> GpuSet:
        return decide_gpus(parse(*argv).resources, host, seen, holdings or Holdings())

    listed = GpuSeen("ok", 4, "0, GPU-0\n1, GPU-1\n2, GPU-2\n3, GPU-3")
    assert decided(plain, "--gpus", "0") == GpuSet(why="CPU mode")
    assert decided(line) == GpuSet((2, 3), "GPU 2,3 as gpu_ids= of hosts:2 lists them (not probed)")
    assert decided(plain, "--gpus", "1,2") == GpuSet((1, 2), "GPU 1,2 as --gpus lists them (not probed)")
    assert decided(plain, "--gpus", "2") == GpuSet(why="the first 2 GPU(s) the node's Docker gives (not probed)")
    assert decided(plain, "--gpus", "2", seen=listed, holdings=Holdings([BOB])) == GpuSet(
        (2, 3), "GPU 2,3 of 4; others: bob/cifar (GPU 0,1)", held=True)
    assert decided(plain, "--gpus", "2", seen=listed, holdings=Holdings(own_gpus=(3, 1))).ids == (3, 1)  # kept
    assert decided(line, seen=listed, holdings=Holdings([BOB])).ids == (2, 3)  # the line's own grant, not 0,1
    refused = decided(plain, "--gpus", "3", seen=listed, holdings=Holdings([BOB]))
    assert refused.refused and refused.why.startswith("--gpus 3: 2 of 4 GPU(s) free here, held by bob/cifar")

    facts = [dataclasses.replace(gpu_facts(4, (), iface="eth0", gpus=4, user="1000:1000", login="ann"),
                                 holdings=Holdings([BOB]))] * 2
    plan = job_plan(parse("--gpus", "2"), Attempt(), HOSTS, "10.0.0.11", facts, None, ("torchrun",))
    assert [n.gpus.ids for n in plan.nodes] == [(2, 3), (2, 3)] and plan.nodes[0].container.gpu_ids == (2, 3)
    assert "#   GPUs: GPU 2,3 of 4; others: bob/cifar (GPU 0,1)" in render_job_plan(plan)
    assert plan_json(plan)["nodes"][1]["gpus"] == {"ids": [2, 3], "why": "GPU 2,3 of 4; others: bob/cifar (GPU 0,1)"}
