"""The GPUs, the device and the network a GPU job's containers get: `--device cuda`, `--gpus` device indices,
InfiniBand/RoCE devices or NCCL on sockets. Pure decisions on real command-line and probe outputs.

Only a GPU node can show the effects (CUDA in the container, Docker's device_ids, NCCL over verbs); these tests pin
the decisions and the exact Docker arguments by construction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kit.probe import probe_facts
from kit.units import HOSTS, SSH, gpus_judged, job_specs, parse

from orchestrate import cli
from orchestrate.backends.docker_ssh.request import docker_run_argv, sdk_kwargs
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.plan.verdicts import Network, judge_transport, settle_transport
from orchestrate.probe.observations import NodeFacts

# Real outputs. `nvidia-smi --query-gpu=index,uuid --format=csv,noheader` on an 8-GPU node, and
# `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader` with one process on GPU 1.
GPU_LIST = "\n".join(f"{i}, GPU-{i}a6b3c2d-1f0e-4d5c-9b8a-7e6f5d4c3b2{i}" for i in range(8))
APPS = "GPU-1a6b3c2d-1f0e-4d5c-9b8a-7e6f5d4c3b21, 48121, /usr/bin/python3\n"
# /dev/infiniband on a ConnectX node, and its ports from /sys/class/infiniband/*/ports/*/{link_layer,state}.
IB_DEVS = "issm0 issm1 rdma_cm umad0 umad1 uverbs0 uverbs1 "
IB_PORTS = "mlx5_0/1 InfiniBand 4: ACTIVE\nmlx5_1/1 InfiniBand 1: DOWN\n"
ROCE_PORTS = "mlx5_bond_0/1 Ethernet 4: ACTIVE\n"


def config(**kw: object) -> UpConfig:
    return UpConfig.of(ssh=SSH, job="exp1", image="ddp-cifar:latest", **kw)  # type: ignore[arg-type]


def trainer_args(spec_command: tuple[str, ...]) -> tuple[str, ...]:
    return spec_command[spec_command.index("trainer") + 1:]


@pytest.mark.parametrize("gpus", ["2", "all", "4-7", "0,1,2"])
def test_a_gpu_job_tells_the_trainer_to_use_cuda(gpus: str) -> None:
    """`auto` would fall back to the CPU in a container without CUDA and train on gloo without a word."""
    (spec, _) = job_specs(parse("--gpus", gpus, "--", "--epochs", "1"), HOSTS, "10.0.0.11",
                          [NodeFacts("eth0", 8)] * 2)
    assert trainer_args(spec.command) == ("--data-dir", "/data", "--ckpt-dir", "/checkpoints", "--device", "cuda",
                                          "--epochs", "1")


def test_a_cpu_job_gets_no_device_and_another_program_no_trainer_option() -> None:
    (spec, _) = job_specs(parse("--gpus", "0"), HOSTS, "10.0.0.11", [NodeFacts("eth0")] * 2)
    assert "--device" not in spec.command
    (spec, _) = job_specs(parse("--entry", "/app/train.py", "--", "--lr", "1"), HOSTS, "10.0.0.11",
                          [NodeFacts("eth0", 8)] * 2)
    assert "--device" not in spec.command and spec.command[-3:] == ("/app/train.py", "--lr", "1")


def test_the_users_device_wins_and_cpu_with_gpus_is_refused() -> None:
    """The user's `--device auto` comes last, and the trainer's parser keeps the last one."""
    (spec, _) = job_specs(parse("--gpus", "2", "--", "--device", "auto"), HOSTS, "10.0.0.11",
                          [NodeFacts("eth0", 8)] * 2)
    assert trainer_args(spec.command)[-4:] == ("--device", "cuda", "--device", "auto")
    with pytest.raises(ConfigError, match="--device cpu with GPUs"):
        parse("--gpus", "2", "--", "--device", "cpu")
    assert parse("--gpus", "0", "--", "--device", "cpu").resources.cpu_mode  # CPU job, CPU device: fine


def test_gpu_indices_go_to_docker_as_device_ids() -> None:
    cfg = parse("--gpus", "4-7")
    assert (cfg.resources.gpus, cfg.resources.gpu_ids) == (4, (4, 5, 6, 7))
    (spec, _) = job_specs(cfg, HOSTS, "10.0.0.11", [NodeFacts("eth0", 8)] * 2)
    (request,) = sdk_kwargs(spec)["device_requests"]
    assert request["DeviceIDs"] == ["4", "5", "6", "7"] and request["Count"] == 0  # the daemon refuses both set
    assert request["Capabilities"] == [["gpu"]]
    # docker/cli reads --gpus as one CSV record: without the quotes, device=4,5 would split at the comma.
    assert '--gpus="device=4,5,6,7"' in docker_run_argv(spec)
    assert spec.command[spec.command.index("--nproc_per_node") + 1] == "4"  # one process per listed GPU
    assert spec.env["NPROC_PER_NODE"] == "4"


def test_counts_all_and_cpu_render_as_before() -> None:
    for gpus, flag in (("2", "--gpus=2"), ("all", "--gpus=all")):
        (spec, _) = job_specs(parse("--gpus", gpus), HOSTS, "10.0.0.11", [NodeFacts("eth0", 8)] * 2)
        assert not sdk_kwargs(spec)["device_requests"][0]["DeviceIDs"] and flag in docker_run_argv(spec)
    (spec, _) = job_specs(parse("--gpus", "0"), HOSTS, "10.0.0.11", [NodeFacts("eth0")] * 2)
    assert not any(a.startswith("--gpus") for a in docker_run_argv(spec))


@pytest.mark.parametrize("text, message", [
    ("1,1", "GPU 1 listed twice"), ("0-3,2", "GPU 2 listed twice"), ("7-4", "range 7-4 is empty"),
    ("0,,1", "give a number of GPUs per node"), ("2-", "give a number of GPUs per node"),
    ("0-5000", "range 0-5000 is empty or above 1023"),
])
def test_bad_gpu_indices_are_one_error_line(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["up", "--hosts", "hosts", "--gpus", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --gpus {text!r}") and message in err[0], err


def test_indices_survive_a_job_file_and_the_stored_job(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from orchestrate import jobfile

    (tmp_path / "job.toml").write_text('hosts = "hosts"\ngpus = "4-7"\nnccl_transport = "socket"\n')
    _, from_file = cli.parse_args(["up", "-f", str(tmp_path / "job.toml")])
    assert isinstance(from_file, UpConfig) and from_file.resources.gpu_ids == (4, 5, 6, 7)
    assert from_file.resources.nccl_transport == "socket"
    cfg = parse("--gpus", "4-7")
    text = jobfile.of_config(cfg)
    assert 'gpus = "4,5,6,7"' in text and "gpu_ids" not in text
    parser = cli.build_parser()
    stored = SimpleNamespace(hosts_file="hosts", ssh_config=None, options={"gpus": 4, "gpu_ids": [4, 5, 6, 7]})
    assert jobfile.from_state(stored, parser.up_parser)["gpus"] == (4, 5, 6, 7)  # type: ignore[attr-defined]


def test_preflight_refuses_indices_the_host_lacks_and_warns_on_busy_gpus() -> None:
    facts = {"smi": "ok", "gpus": "4", "gpu_list": "\n".join(GPU_LIST.splitlines()[:4])}
    decided, cell = gpus_judged(facts, parse("--gpus", "2-5").resources)
    assert not cell.ok and cell.text == "--gpus 2,3,4,5: GPU 4,5 not on this host (it has 0,1,2,3); choose among those"
    assert decided.refused and decided.ids == ()
    busy = {**facts, "gpus": "8", "gpu_list": GPU_LIST, "compute_apps": APPS}
    decided, cell = gpus_judged(busy, parse("--gpus", "0-3").resources)
    assert cell.ok and cell.warn and decided.ids == (0, 1, 2, 3)
    assert cell.text == "GPU 0,1,2,3 of 8; busy: GPU 1 (pid 48121 /usr/bin/python3)"
    assert decided.why == "GPU 0,1,2,3 of 8"  # the dry run's reason: the warning is the table's
    _, cell = gpus_judged(busy, parse("--gpus", "4-7").resources)  # GPU 1 is not ours: no warning
    assert cell.text == "GPU 4,5,6,7 of 8" and not cell.warn
    _, cell = gpus_judged(busy, parse("--gpus", "2").resources)  # a count means Docker's first N: GPU 1 is among them
    assert cell.warn


def test_the_probe_script_reports_gpus_and_rdma_ports_in_the_formats_parsed(tmp_path: Path) -> None:
    """The probe's GPU block runs for real with a stand-in nvidia-smi printing the real CSV formats; no host here
    has /dev/infiniband, so the RDMA records are empty (making one would need root changes to the host's /dev)."""
    import os

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) printf '%s\\n' '{GPU_LIST.splitlines()[0]}';;"
                   f" --query-compute-apps=*) printf '%s' '{APPS.strip()}';; esac\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    facts = probe_facts(str(tmp_path), str(tmp_path), str(tmp_path), gpus=True, env=env)
    assert facts["smi"] == "ok" and facts["gpus"] == "1" and facts["gpu_list"] == GPU_LIST.splitlines()[0]
    assert facts["compute_apps"] == APPS.strip()
    assert "ib_devs" in facts and "rdma_ports" in facts


def test_the_probe_finds_rdma_devices_where_they_are(tmp_path: Path) -> None:
    """Needs root: the probe runs for real in a private mount namespace holding stand-in /dev/infiniband and
    /sys/class/infiniband (the host's stay untouched); no node here has an HCA."""
    stand_in = Path(__file__).parent / "data" / "rdma_stand_in.sh"
    facts = probe_facts(str(tmp_path), str(tmp_path), str(tmp_path), gpus=True,
                        wrap=["unshare", "-m", "--propagation", "private", "sh", str(stand_in), str(tmp_path)])
    assert facts["ib_devs"].split() == ["rdma_cm", "umad0", "uverbs0"]
    assert facts["rdma_ports"].splitlines() == ["mlx5_0/1 InfiniBand 4: ACTIVE", "mlx5_1/1 Ethernet 1: DOWN"]
    net = judge_transport(facts, parse("--nccl-transport", "ib").resources)
    assert net.ib and net.check.ok and net.check.text == "IB mlx5_0"


def transport_of(devs: str, ports: str, choice: str = "auto") -> Network:
    return judge_transport({"ib_devs": devs, "rdma_ports": ports}, parse("--nccl-transport", choice).resources)


def problems(net: Network) -> list[str]:
    return [] if net.check.ok else [f"net: {net.check.text}"]


def test_preflight_shows_the_transport_per_node_and_refuses_forced_ib_without_it() -> None:
    assert transport_of(IB_DEVS, IB_PORTS).check.text == "IB mlx5_0" and transport_of(IB_DEVS, IB_PORTS).ib
    assert transport_of(IB_DEVS, ROCE_PORTS).check.text == "RoCE mlx5_bond_0"
    no_port = transport_of(IB_DEVS, "mlx5_0/1 InfiniBand 1: DOWN\n")
    assert no_port.check.text == "sockets (RDMA device, no active port)" and no_port.ib is False
    assert transport_of("", "").check.text == "sockets" and not problems(transport_of("", ""))
    assert problems(transport_of("", "", "ib")) == [
        "net: --nccl-transport ib, but no InfiniBand/RoCE device (/dev/infiniband has no uverbs*) here; "
        "use --nccl-transport auto or socket"]
    assert "no active RDMA port" in problems(transport_of(IB_DEVS, "mlx5_0/1 InfiniBand 1: DOWN\n", "ib"))[0]
    assert transport_of(IB_DEVS, IB_PORTS, "socket").check.text == "sockets (--nccl-transport socket)"


def test_one_node_without_ib_puts_the_job_on_sockets_and_the_table_says_so() -> None:
    with_ib, without = settle_transport([transport_of(IB_DEVS, IB_PORTS), transport_of("", "")], parse().resources)
    assert with_ib.check.text == "sockets (IB mlx5_0 idle: not every node has IB)" and with_ib.check.ok
    assert with_ib.check.warn and without == transport_of("", "")


def test_ib_nodes_get_the_devices_and_ipc_lock() -> None:
    (spec, _) = job_specs(parse("--gpus", "8"), HOSTS, "10.0.0.11", [NodeFacts("eth0", 8, ib=True)] * 2)
    kwargs = sdk_kwargs(spec)
    assert kwargs["devices"] == ["/dev/infiniband"] and kwargs["cap_add"] == ["IPC_LOCK"]
    assert "NCCL_IB_DISABLE" not in spec.env
    shown = docker_run_argv(spec)
    assert "--device=/dev/infiniband" in shown and "--cap-add=IPC_LOCK" in shown
    assert "--ulimit=memlock=-1:-1" in shown  # verbs pin memory: the GPU ulimits already allow it


def test_sockets_when_a_node_lacks_ib_or_when_asked() -> None:
    for choice, ib in (("auto", [True, False]), ("socket", [True, True])):
        specs = job_specs(parse("--gpus", "8", "--nccl-transport", choice), HOSTS, "10.0.0.11",
                          [NodeFacts("eth0", 8, ib=i) for i in ib])
        for spec in specs:
            assert spec.env["NCCL_IB_DISABLE"] == "1" and sdk_kwargs(spec)["devices"] is None
            assert "--env=NCCL_IB_DISABLE=1" in docker_run_argv(spec)
    (spec, _) = job_specs(parse("--nccl-transport", "socket", "--env", "NCCL_IB_DISABLE=0"), HOSTS, "10.0.0.11",
                          [NodeFacts("eth0", 8, ib=True)] * 2)
    assert spec.env["NCCL_IB_DISABLE"] == "0"  # the user's --env wins


def test_an_offline_dry_run_adds_nothing_for_auto_and_the_forced_choice_otherwise() -> None:
    (spec, _) = job_specs(parse(), HOSTS, "10.0.0.11")
    assert sdk_kwargs(spec)["devices"] is None and "NCCL_IB_DISABLE" not in spec.env
    (spec, _) = job_specs(parse("--nccl-transport", "ib"), HOSTS, "10.0.0.11")
    assert sdk_kwargs(spec)["cap_add"] == ["IPC_LOCK"]


def test_cpu_jobs_take_no_transport_and_check_takes_it_too() -> None:
    with pytest.raises(ConfigError, match="--nccl-transport 'ib'.*--gpus 0 runs on gloo"):
        parse("--gpus", "0", "--nccl-transport", "ib")
    (spec, _) = job_specs(parse("--gpus", "0"), HOSTS, "10.0.0.11", [NodeFacts("eth0", ib=True)] * 2)
    assert sdk_kwargs(spec)["devices"] is None and "NCCL_IB_DISABLE" not in spec.env
    _, cfg = cli.parse_args(["check", "--hosts", "hosts", "--gpus", "4-7", "--nccl-transport", "socket"])
    assert isinstance(cfg, UpConfig) and cfg.resources.nccl_transport == "socket" and cfg.resources.gpu_ids == (4, 5, 6, 7)
    assert cfg.resources.gpus == 4 and GPUS_ALL == -1


def test_the_python_api_takes_indices_as_gpus() -> None:
    from orchestrate.api import Job

    job = Job("hosts", gpus=(4, 5))
    assert (job.resources.gpus, job.resources.gpu_ids) == (2, (4, 5))
    with pytest.raises(ConfigError, match="give each device index once"):
        Job("hosts", gpus=(1, 1))


def test_the_network_check_runs_on_the_jobs_transport() -> None:
    from orchestrate.checks.netcheck import script
    from orchestrate.plan.shortlived import network_check

    for ib, expect in ((True, ("/dev/infiniband",)), (False, ())):
        specs = job_specs(parse("--gpus", "8"), HOSTS, "10.0.0.11", [NodeFacts("eth0", 8, ib=ib)] * 2)
        checks = network_check(specs, False, 8, script())
        assert [c.devices for c in checks] == [expect] * 2
        assert all(("NCCL_IB_DISABLE" in c.env) is (not ib) for c in checks)


def test_a_hosts_files_gpu_ids_set_the_processes_the_offline_dry_run_shows(tmp_path: Path) -> None:
    """`slots=2 gpu_ids=0` with --gpus left out: preflight grants GPU 0 alone, so one process, not two."""
    from orchestrate.hosts import Host

    host = Host("gpu-a", "gpu-a", 22, None, slots=2, gpu_ids=(0,))
    (spec,) = job_specs(config(), [host], "10.0.0.11")
    assert (spec.env["NPROC_PER_NODE"], spec.gpu_ids) == ("1", (0,))
    assert '--gpus="device=0"' in docker_run_argv(spec)
