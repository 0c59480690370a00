"""docker/entrypoint.sh and docker/nccl.env: defaults applied, a set variable wins, the command is exec()ed.

The first tests run the script with the host's /bin/sh (no Docker needed); the last ones run it in the image.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from kit.image_helpers import logs_of, remove, run, start
from kit.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
NCCL_ENV = REPO / "docker" / "nccl.env"
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def nccl_defaults() -> dict[str, str]:
    pairs = (ASSIGNMENT.match(line) for line in NCCL_ENV.read_text().splitlines())
    return {m.group(1): m.group(2) for m in pairs if m}


def run_entrypoint(args: list[str], env: dict[str, str], script: Path = ENTRYPOINT) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(["sh", str(script), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=30, check=False)


def env_of(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def test_nccl_env_is_well_formed_and_every_setting_is_documented() -> None:
    lines = NCCL_ENV.read_text().splitlines()
    keys = []
    for i, line in enumerate(lines):
        if not line.strip() or line.startswith("#"):
            continue
        assert ASSIGNMENT.match(line), f"nccl.env line {i + 1} is not KEY=VALUE: {line!r}"
        key = line.split("=", 1)[0]
        keys.append(key)
        # Documented line by line: the paragraph a setting belongs to has a comment naming it.
        j = i - 1
        while j >= 0 and lines[j].strip():
            j -= 1
        comments = [c for c in lines[j + 1:i] if c.startswith("#")]
        assert any(key in c for c in comments), f"nccl.env line {i + 1}: no comment above {key} says what it does"
    assert "NCCL_DEBUG" in keys and "NCCL_SOCKET_IFNAME" in keys
    assert len(keys) == len(set(keys)), "a variable is set twice in nccl.env"


def test_defaults_are_applied_when_unset() -> None:
    done = run_entrypoint(["env"], {})
    assert done.returncode == 0, done.stderr
    got = env_of(done.stdout)
    for key, value in nccl_defaults().items():
        assert got.get(key) == value, f"{key}: expected default {value!r}, got {got.get(key)!r}"


def test_a_set_variable_wins_even_when_empty() -> None:
    done = run_entrypoint(["env"], {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": ""})
    got = env_of(done.stdout)
    assert got["NCCL_DEBUG"] == "INFO"
    assert got["NCCL_SOCKET_IFNAME"] == ""


def test_the_command_replaces_the_shell() -> None:
    """exec, not a child: the command keeps the entrypoint's PID, so signals reach it directly."""
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    out, _ = proc.communicate(timeout=30)
    assert int(out.strip()) == proc.pid


def test_arguments_pass_through_unchanged() -> None:
    done = run_entrypoint(["printf", "[%s]", "a b", "", "$HOME", "*"], {})
    assert done.stdout == "[a b][][$HOME][*]"


def test_exit_code_of_the_command_is_kept() -> None:
    assert run_entrypoint(["sh", "-c", "exit 7"], {}).returncode == 7


def test_no_command_is_an_error() -> None:
    done = run_entrypoint([], {})
    assert done.returncode == 2
    assert "no command" in done.stderr


def test_malformed_lines_are_reported_and_never_evaluated(tmp_path: Path) -> None:
    script = tmp_path / "entrypoint.sh"
    shutil.copy(ENTRYPOINT, script)
    marker = tmp_path / "pwned"
    (tmp_path / "nccl.env").write_text(f"# comment\nGOOD=1\nBAD KEY=2\n$(touch {marker})=3\n\nLAST=x=y")
    done = run_entrypoint(["env"], {}, script=script)
    got = env_of(done.stdout)
    assert got["GOOD"] == "1" and got["LAST"] == "x=y"
    assert "malformed" in done.stderr and "BAD KEY" in done.stderr
    assert not marker.exists()


def test_a_lease_renewed_keeps_the_command_and_a_lapsed_or_absent_one_sends_it_sigterm(tmp_path: Path) -> None:
    """DDP_LEASE_FILE/DDP_LEASE_S (a Slurm job's guard, docs/slurm.md): while a new number comes into the file
    within each lease, the command runs; once none comes for the lease, it gets SIGTERM (exit 143 here, by its
    trap). A command whose lease never comes (only an earlier job's file is there) gets it too."""
    lease_s = 2
    command = ["sh", "-c", "trap 'exit 143' TERM; while :; do sleep 0.1; done"]
    renewed, old = tmp_path / "renewed.lease", tmp_path / "old.lease"
    old.write_text("7\n")  # left by an earlier job: renews nothing

    def start(lease: Path, name: str) -> subprocess.Popen[bytes]:
        env = {"PATH": "/usr/bin:/bin", "DDP_LEASE_FILE": str(lease), "DDP_LEASE_S": str(lease_s)}
        with (tmp_path / name).open("wb") as err:
            return subprocess.Popen(["sh", str(ENTRYPOINT), *command], env=env, stderr=err)

    kept, orphan = start(renewed, "kept.err"), start(old, "orphan.err")
    try:
        began = time.monotonic()
        for n in range(8):  # 4 s, 2 leases
            renewed.write_text(f"{n}\n")
            time.sleep(0.5)
        assert kept.poll() is None, (tmp_path / "kept.err").read_text()
        assert orphan.wait(timeout=1) == 143  # long ended: its lease lapsed 2 s (+1 s of polling) after its start
        last = time.monotonic()
        assert kept.wait(timeout=lease_s + 3) == 143
        print(f"renewed: SIGTERM {time.monotonic() - last:.1f} s after the last renewal ({time.monotonic() - began:.1f} s in all)")
    finally:
        for proc in (kept, orphan):
            proc.kill()
            proc.wait(timeout=10)
    for name in ("kept.err", "orphan.err"):
        assert "not renewed for 2 s (its guard is gone): SIGTERM" in (tmp_path / name).read_text()
    bad = run_entrypoint(["true"], {"DDP_LEASE_FILE": str(renewed), "DDP_LEASE_S": "1m"})
    assert bad.returncode == 2 and "DDP_LEASE_S=1m is not a whole number of seconds" in bad.stderr


@pytest.mark.docker
def test_in_the_image_defaults_apply_and_set_variables_win(docker_client: docker.DockerClient,
                                                           cpu_image: str) -> None:
    done = run(docker_client, cpu_image, ["env"], environment={"NCCL_DEBUG": "TRACE"})
    assert done.exit_code == 0, done.logs
    got = env_of(done.logs)
    assert got["NCCL_DEBUG"] == "TRACE"
    for key, value in nccl_defaults().items():
        if key != "NCCL_DEBUG":
            assert got.get(key) == value, key


@pytest.mark.docker
def test_in_the_image_the_command_is_a_direct_child_of_init(docker_client: docker.DockerClient,
                                                            cpu_image: str) -> None:
    """Under --init, PID 1 is Docker's tini and the command its child: no shell in between to eat SIGTERM."""
    done = run(docker_client, cpu_image,
               ["python", "-c", "import os; print(os.getppid(), open('/proc/1/comm').read().strip())"])
    assert done.exit_code == 0, done.logs
    ppid, init_name = done.logs.split()
    assert ppid == "1"
    assert init_name != "sh" and init_name != "python"


def test_entrypoint_is_executable() -> None:
    """The Dockerfile uses the script as ENTRYPOINT directly, so the file mode must carry the x bit."""
    assert os.access(ENTRYPOINT, os.X_OK)


# A stand-in for NGC's /opt/nvidia/nvidia_entrypoint.sh: like the real one (it sources entrypoint.d/*.sh, where
# the CUDA forward-compatibility setup exports LD_LIBRARY_PATH, then ends in `exec "$@"`), it changes the
# environment of the command and exec()s it.
NGC_STAND_IN = """#!/bin/sh
echo "ngc entrypoint ran" >&2
export NGC_STAND_IN_RAN=1
exec "$@"
"""


@pytest.fixture(scope="module")
def ngc_like_image(docker_client: docker.DockerClient, cpu_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The CPU image with a stand-in NGC entrypoint at NGC's path (no NGC image can be pulled here)."""
    context = tmp_path_factory.mktemp("ngc-like")
    (context / "nvidia_entrypoint.sh").write_text(NGC_STAND_IN)
    (context / "nvidia_entrypoint.sh").chmod(0o755)
    (context / "Dockerfile").write_text(f"FROM {cpu_image}\nCOPY nvidia_entrypoint.sh /opt/nvidia/nvidia_entrypoint.sh\n")
    tag = f"ddp-cifar-test-ngc-like:{os.getpid()}"
    docker_client.images.build(path=str(context), tag=tag, rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)


@pytest.mark.docker
def test_an_ngc_entrypoint_runs_before_the_command_and_our_defaults_reach_it(
        docker_client: docker.DockerClient, ngc_like_image: str) -> None:
    done = run(docker_client, ngc_like_image, ["env"])
    assert done.exit_code == 0, done.logs
    assert "ngc entrypoint ran" in done.logs
    got = env_of(done.logs)
    assert got.get("NGC_STAND_IN_RAN") == "1", "the command did not run under NGC's entrypoint"
    assert got.get("NCCL_DEBUG") == nccl_defaults()["NCCL_DEBUG"]


@pytest.mark.docker
def test_under_an_ngc_entrypoint_the_command_still_gets_sigterm(docker_client: docker.DockerClient,
                                                                ngc_like_image: str) -> None:
    """`docker stop` under --init: tini's SIGTERM reaches the command through both exec()s (exit 143, not the
    SIGKILL that a shell in between would have caused)."""
    program = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
               "print('ready', os.getppid(), flush=True)\n"
               "time.sleep(120)\n")
    container = start(docker_client, ngc_like_image, ["python3", "-c", program])
    try:
        wait_until(lambda: "ready" in logs_of(container), 60, "the program's ready line", every=0.2)
        assert "ready 1" in logs_of(container), logs_of(container)
        container.stop(timeout=30)
        assert container.wait(timeout=30)["StatusCode"] == 143, logs_of(container)
    finally:
        remove(container)
