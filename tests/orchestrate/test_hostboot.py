"""What a host's boot id and dockerd's pid + start time tell about a node whose Docker API stopped answering."""

from __future__ import annotations

import subprocess

import pytest

from orchestrate.backends.docker_ssh.hostboot import SCRIPT, parse_boot
from orchestrate.probe.bootchange import Boot, Change, change

BEFORE = Boot("b-1", "4242 1000")


@pytest.mark.parametrize(("now", "seen"), [
    (Boot("b-1", "4242 1000"), Change.NONE),
    (Boot("b-1", "5151 2000"), Change.RESTARTED),
    (Boot("b-1", "4242 2000"), Change.RESTARTED),  # the same pid again after a restart: the start time differs
    (Boot("b-1", None), Change.DAEMON_DOWN),
    (Boot("b-2", "4242 1000"), Change.REBOOTED),  # pids repeat after a boot: the boot id tells
    (Boot("b-2", None), Change.REBOOTED),
])
def test_change_since_the_job_started(now: Boot, seen: Change) -> None:
    assert change(BEFORE, now) is seen


def test_without_a_pid_file_only_a_reboot_can_be_told() -> None:
    assert change(Boot("b-1", None), Boot("b-1", None)) is Change.NONE
    assert change(Boot("b-1", None), Boot("b-2", None)) is Change.REBOOTED
    assert change(None, Boot("b-2", None)) is Change.NONE


def test_causes_name_the_host() -> None:
    assert Change.RESTARTED.cause("h1") == "Docker daemon on h1 restarted"
    assert Change.REBOOTED.cause("h1") == "h1 rebooted"
    assert Change.DAEMON_DOWN.cause("h1") == "Docker daemon on h1 is down (sshd answers)"
    assert [c for c in Change if c.ended_the_job] == [Change.REBOOTED, Change.RESTARTED]


def test_parse() -> None:
    assert parse_boot("b-1\n4242 1000\n") == Boot("b-1", "4242 1000")
    assert parse_boot("b-1\n") == Boot("b-1", None)
    assert parse_boot("") is None


def test_the_script_on_this_machine_reads_the_boot_id() -> None:
    """The real script under sh: line 1 is the kernel's boot id (the pid file may or may not exist here)."""
    out = subprocess.run(["sh", "-c", SCRIPT], capture_output=True, text=True, timeout=10, check=True).stdout
    boot = parse_boot(out)
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot is not None and boot.boot_id == f.read().strip()
