"""Plans are plain data: the containers `up` would start, asserted for GPU and CPU modes, and --dry-run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from kit.units import SSH, job_specs
from rich.console import Console

from orchestrate import cli
from orchestrate.backends.docker_ssh.request import docker_run_argv, sdk_kwargs
from orchestrate.config import UpConfig
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt
from orchestrate.probe.observations import NodeFacts

HOSTS = [Host(name="gpu1", hostname="10.0.0.11", port=22, user="u", slots=None),
         Host(name="gpu2", hostname="10.0.0.12", port=22, user="u", slots=None, iface="ib0",
              ckpt_dir="/scratch/{job}/ck")]


def config(**kw: object) -> UpConfig:
    return UpConfig.of(ssh=SSH, job="exp1", image="ddp-cifar:latest", **kw)  # type: ignore[arg-type]


def test_gpu_plan_all_gpus() -> None:
    facts = [NodeFacts(iface="eth0", gpus=8), NodeFacts(iface="eth9", gpus=4)]
    specs = job_specs(config(gpus=GPUS_ALL, master_port=29500, trainer_args=("--epochs", "3")), HOSTS, "10.0.0.11",
                      facts)
    n0, n1 = specs
    assert n0.name == "exp1-node0" and n1.name == "exp1-node1"
    assert n0.command == ("torchrun", "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.0.0.11",
                          "--master_port", "29500", "--nproc_per_node", "8",
                          "--log-dir", "/logs", "--redirects", "3", "--tee", "3", "-m", "trainer",
                          "--data-dir", "/data", "--ckpt-dir", "/checkpoints", "--device", "cuda", "--epochs", "3")
    assert n1.command[n1.command.index("--nproc_per_node") + 1] == "4"
    assert n1.command[n1.command.index("--node_rank") + 1] == "1"
    assert n0.env["NCCL_SOCKET_IFNAME"] == n0.env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert n1.env["NCCL_SOCKET_IFNAME"] == "ib0"  # the hosts file's iface= wins over detection
    # The image's async error handling (3: tear down after the flight recorder dumped) is not overridden, and
    # the dumps land in the node's log dir, which outlives the container.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in n0.env
    assert n0.env["TORCH_FR_DUMP_TEMP_FILE"] == "/logs/nccl_trace_rank_"
    assert (n1.env["MASTER_ADDR"], n1.env["MASTER_PORT"], n1.env["NODE_RANK"], n1.env["NNODES"]) == \
        ("10.0.0.11", "29500", "1", "2")
    assert n0.labels == {"ddp-cifar.job": "exp1", "ddp-cifar.node-rank": "0", "ddp-cifar.nnodes": "2",
                         "ddp-cifar.version": "0.1.0", "ddp-cifar.restart": "0", "ddp-cifar.restart-cause": "",
                         "ddp-cifar.master-port": "29500"}
    assert "DDP_RESTART" not in n0.env and "--keep-global-batch" not in n0.command
    assert n0.gpus == GPUS_ALL and ("memlock", -1, -1) in n0.ulimits and ("stack", 67108864, 67108864) in n0.ulimits
    assert n0.ipc_mode == "host" and n0.init and n0.network_mode == "host"
    assert [(m.source, m.target) for m in n1.mounts] == [
        ("~/.cache/ddp-cifar/data", "/data"), ("/scratch/exp1/ck", "/checkpoints"),
        ("~/.local/share/ddp-cifar/jobs/exp1/logs", "/logs")]
    kwargs = sdk_kwargs(n0)
    assert kwargs["privileged"] is False and kwargs["init"] is True and kwargs["network_mode"] == "host"
    assert kwargs["device_requests"][0]["Count"] == -1 and kwargs["device_requests"][0]["Capabilities"] == [["gpu"]]
    assert all("docker.sock" not in m["Source"] for m in kwargs["mounts"])  # never the Docker socket
    assert {u["Name"] for u in kwargs["ulimits"]} == {"memlock", "stack"}


def test_gpu_plan_n_gpus_and_resume() -> None:
    specs = job_specs(config(gpus=2, resume=True), HOSTS, "10.0.0.11", [NodeFacts("eth0", 8)] * 2)
    assert specs[0].gpus == 2 and specs[0].command[-1] == "--resume"
    assert specs[0].command[specs[0].command.index("--nproc_per_node") + 1] == "2"
    assert sdk_kwargs(specs[0])["device_requests"][0]["Count"] == 2


def test_cpu_plan() -> None:
    specs = job_specs(config(gpus=0, nproc_per_node=2, shm_size="2g"), HOSTS, "10.0.0.11",
                      [NodeFacts("eth0"), NodeFacts("eth1")])
    n0 = specs[0]
    assert n0.gpus == 0 and sdk_kwargs(n0)["device_requests"] is None
    assert "NCCL_SOCKET_IFNAME" not in n0.env and n0.env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert n0.env["NPROC_PER_NODE"] == "2" and "--nproc_per_node" in n0.command
    assert n0.ipc_mode is None and n0.shm_size == "2g"
    assert n0.ulimits == (("stack", 67108864, 67108864),)  # no memlock: capped daemons refuse it


def test_a_memory_limit_is_in_the_plan_and_its_docker_run_line() -> None:
    """--memory: Docker's mem_limit, with no swap beyond it (memswap_limit equal), shown as `docker run` flags."""
    (limited,) = job_specs(config(gpus=0, memory="512m"), HOSTS[:1], "a", [NodeFacts("eth0")])
    kwargs = sdk_kwargs(limited)
    assert (kwargs["mem_limit"], kwargs["memswap_limit"]) == ("512m", "512m")
    assert {"--memory=512m", "--memory-swap=512m"} <= set(docker_run_argv(limited))
    (free,) = job_specs(config(gpus=0), HOSTS[:1], "a", [NodeFacts("eth0")])
    assert sdk_kwargs(free)["mem_limit"] is None
    assert not [a for a in docker_run_argv(free) if a.startswith("--memory")]


def test_cpu_plan_slots_default_to_processes() -> None:
    hosts = [Host(name="a", hostname="a", port=22, user=None, slots=3)]
    (spec,) = job_specs(config(gpus=0), hosts, "a", [NodeFacts("eth0")])
    assert spec.command[spec.command.index("--nproc_per_node") + 1] == "3"


def test_user_env_and_secret_masking() -> None:
    env = (("WANDB_API_KEY", "s3cr3t"), ("NCCL_DEBUG", "INFO"), ("X", "$(touch /tmp/owned); `id`\nls"))
    (spec, _) = job_specs(config(gpus=0, env=env), HOSTS, "10.0.0.11", [NodeFacts("eth0")] * 2)
    assert spec.env["WANDB_API_KEY"] == "s3cr3t"  # the container gets the value ...
    shown = docker_run_argv(spec)
    assert "--env=WANDB_API_KEY=****" in shown and "s3cr3t" not in " ".join(shown)  # ... the output does not
    assert "--env=NCCL_DEBUG=INFO" in shown


def test_dry_run_prints_every_node_masked_and_quoted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config
    import orchestrate.remote.ssh as ssh

    monkeypatch.setattr(ssh.Connection, "open", lambda *a, **k: pytest.fail("dry run must not connect"))
    console = Console(width=1000, highlight=False)
    code = cli.run(["up", "--dry-run", "--hosts", str(hosts), "--gpus", "0", "--image", "ddp-cifar:cpu", "--job", "j1",
                    "--env", "MY_TOKEN=tok-123", "--env", "EVIL=$(touch /tmp/owned)",
                    "--", "--epochs", "2", "--batch-size", "32"], console)
    out = capsys.readouterr().out
    assert code == 0
    assert "tok-123" not in out and "MY_TOKEN=****" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("docker run")]
    assert len(lines) == 2
    argv = shlex.split(lines[1])  # the printed command is valid, quoted shell
    assert "--env=EVIL=$(touch /tmp/owned)" in argv and "j1-node1" in argv
    assert argv[argv.index("ddp-cifar:cpu"):][:12] == ["ddp-cifar:cpu", "torchrun", "--nnodes", "2", "--node_rank", "1",
                                                        "--master_addr", "node-a", "--master_port",
                                                        "<detected at launch>", "--nproc_per_node", "1"]
    assert argv[-4:] == ["--epochs", "2", "--batch-size", "32"]


def test_an_automatic_restart_resumes_keeps_the_global_batch_and_says_why() -> None:
    cfg = config(gpus=0, trainer_args=("--epochs", "3"))  # the user's config is never rewritten for a restart
    attempt = Attempt(2, "node 1 (b) exited with code 1", resume=True)
    n0 = job_specs(cfg, HOSTS, "10.0.0.11", attempt=attempt)[0]
    assert n0.command[-3:] == ("3", "--resume", "--keep-global-batch")
    assert (n0.env["DDP_RESTART"], n0.env["DDP_RESTART_CAUSE"]) == ("2", "node 1 (b) exited with code 1")
    assert n0.labels["ddp-cifar.restart"] == "2" and n0.labels["ddp-cifar.restart-cause"].startswith("node 1")
    # Another program gets the environment, not the trainer's option.
    other = job_specs(cfg.with_options(entry="-m app.train", trainer_args=("--x",)), HOSTS, "10.0.0.11",
                      attempt=attempt)[0]
    assert "--keep-global-batch" not in other.command and other.env["DDP_RESTART"] == "2"


def test_every_node_can_name_its_peers_addresses() -> None:
    """c10d warns on each connection whose peer address has no name (no reverse DNS on most clusters)."""
    facts = [NodeFacts(iface="eth0", addr="10.0.0.11"), NodeFacts(iface="eth0", addr="10.0.0.12")]
    for spec in job_specs(config(gpus=0), HOSTS, "10.0.0.11", facts):
        assert sdk_kwargs(spec)["extra_hosts"] == ["ddp-node0:10.0.0.11", "ddp-node0:::ffff:10.0.0.11",
                                                    "ddp-node1:10.0.0.12", "ddp-node1:::ffff:10.0.0.12"]
        assert "--add-host=ddp-node1:::ffff:10.0.0.12" in docker_run_argv(spec)
    assert sdk_kwargs(job_specs(config(gpus=0), HOSTS, "10.0.0.11")[0])["extra_hosts"] is None


def test_the_printed_command_is_rendered_from_what_launch_applies() -> None:
    """--dry-run once printed --volume (which creates a missing folder as root) while launch applied a bind
    mount, and left out the stop signal: the printed line now comes from sdk_kwargs itself."""
    (spec, _) = job_specs(config(gpus=2), HOSTS, "10.0.0.11", [NodeFacts("eth0", user="1000:1000")] * 2)
    shown = docker_run_argv(spec)
    kwargs = sdk_kwargs(spec)
    mounts = [a for a in shown if a.startswith("--mount=")]
    assert mounts == [f"--mount=type=bind,source={m['Source']},target={m['Target']}" + (",readonly" if m["ReadOnly"]
                                                                                     else "")
                      for m in kwargs["mounts"]] and mounts
    assert not any(a.startswith("--volume") for a in shown)
    assert "--stop-signal=SIGTERM" in shown and "--gpus=2" in shown and "--user=1000:1000" in shown
    assert shown[-len(spec.command) - 1:] == [spec.image, *spec.command]


@pytest.mark.parametrize(("hosts_text", "expected"), [
    ("node-a slots=1\nnode-b slots=1\n",
     "# pipeline: --pp 2 over 2 processes: 2 stages x 1 data-parallel replicas; stage s on ranks s*1 .. s*1+0"),
    ("node-a slots=1\nnode-b slots=1\nnode-c slots=1\n",
     "error: trainer option --pp 2: 3 node(s) x processes per node = 3 processes, not divisible by 2; change --pp, "
     "the hosts or --nproc-per-node"),
    ("node-a\nnode-b\n", "# pipeline: --pp 2; the processes per node are detected at launch, and must divide by 2"),
])
def test_the_dry_run_says_how_pp_lays_out_and_refuses_a_world_it_does_not_divide(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, hosts_text: str,
        expected: str) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_text)
    monkeypatch.setenv("HOME", str(tmp_path))
    import orchestrate.remote.ssh as ssh

    monkeypatch.setattr(ssh.Connection, "open", lambda *a, **k: pytest.fail("dry run must not connect"))
    gpus = ["--gpus", "0"] if "slots" in hosts_text else []  # GPUs per node: known only once probed
    code = cli.main(["up", "--dry-run", "--hosts", str(hosts), *gpus, "--image", "ddp-cifar:cpu", "--job", "j1",
                     "--", "--model", "resnet20-gn", "--pp", "2"])
    captured = capsys.readouterr()
    assert code == (2 if expected.startswith("error:") else 0)
    lines = (captured.err if code else captured.out).splitlines()
    assert expected in lines
