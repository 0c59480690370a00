"""docker/entrypoint.sh and docker/nccl.env: defaults applied, a set variable wins, the command is exec()ed.

The first tests run the script with the host's /bin/sh (no Docker needed); the last ones run it in the image.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import docker
import pytest
from image_helpers import run

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
