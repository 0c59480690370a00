"""The `docker run` line --dry-run prints means what launch applies: the real docker CLI and the SDK each create
the container of one GPU + InfiniBand plan on the local dockerd, and the daemon holds the same settings.

Needs the local dockerd (creates, never starts: no GPU or /dev/infiniband is needed to compare the requests).
"""

from __future__ import annotations

import shlex
import subprocess
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
from kit.units import job_specs

from orchestrate import cli
from orchestrate.backends.docker_ssh.request import docker_run_argv, sdk_kwargs
from orchestrate.config import UpConfig
from orchestrate.hosts import Host
from orchestrate.probe.observations import NodeFacts

pytestmark = pytest.mark.docker

COMPARED = ("DeviceRequests", "Devices", "CapAdd", "Ulimits", "Mounts", "Init", "IpcMode", "NetworkMode",
            "ExtraHosts", "Privileged")


def settings(inspect: dict[str, Any]) -> dict[str, Any]:
    host = {k: inspect["HostConfig"].get(k) for k in COMPARED}
    # The CLI writes capabilities as CAP_IPC_LOCK, the SDK as given; the daemon takes both (moby's caps package).
    host["CapAdd"] = [c.removeprefix("CAP_") for c in host["CapAdd"] or ()]
    config = inspect["Config"]
    return {**host, "Env": sorted(config["Env"]), "Labels": config["Labels"], "Cmd": config["Cmd"],
            "User": config["User"], "StopSignal": config.get("StopSignal")}


def test_the_printed_gpu_and_ib_flags_create_what_the_sdk_creates(docker_client: docker.DockerClient,
                                                                    cpu_image: str, tmp_path: Path) -> None:
    """An unquoted `--gpus=device=4,5` makes the CLI ask for GPU 4 and a count of 5 (seen on dockerd 20.10)."""
    for name in ("d", "c", "l"):
        (tmp_path / name).mkdir()
    _, cfg = cli.parse_args(["up", "--hosts", "hosts", "--image", cpu_image, "--gpus", "4-7",
                             "--nccl-transport", "ib", "--data-dir", str(tmp_path / "d"),
                             "--ckpt-dir", str(tmp_path / "c"), "--log-dir", str(tmp_path / "l")])
    assert isinstance(cfg, UpConfig)
    host = Host(name="n0", hostname="10.0.0.11", port=22, user=None, slots=None)
    (spec,) = job_specs(cfg, [host], "10.0.0.11", [NodeFacts("eth0", 8, user="1000:1000", addr="10.0.0.11")])
    tag = uuid.uuid4().hex[:10]
    argv = docker_run_argv(spec)
    assert argv[:2] == ["docker", "run"] and "--detach" in argv
    cli_argv = ["docker", "create", *[a for a in argv[2:] if a != "--detach"]]
    cli_argv[cli_argv.index("--name") + 1] = f"gpudev-cli-{tag}"
    kwargs = {k: v for k, v in sdk_kwargs(spec).items() if k != "detach"}
    kwargs["name"] = f"gpudev-sdk-{tag}"
    made = []
    try:
        made.append(docker_client.containers.create(**kwargs))
        res = subprocess.run(cli_argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{shlex.join(cli_argv)}: {res.stderr}"
        made.append(docker_client.containers.get(res.stdout.strip()))
        sdk, printed = (settings(c.attrs) for c in made)
        assert printed == sdk
        assert sdk["DeviceRequests"][0]["DeviceIDs"] == ["4", "5", "6", "7"] and sdk["DeviceRequests"][0]["Count"] == 0
        assert sdk["Devices"][0]["PathOnHost"] == "/dev/infiniband" and sdk["CapAdd"] == ["IPC_LOCK"]
    finally:
        for container in made:
            container.remove(force=True)
