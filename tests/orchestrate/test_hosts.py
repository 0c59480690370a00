"""Hosts-file parsing: good lines resolve through the ssh config; bad lines name the file and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.errors import HostsFileError
from orchestrate.hosts import parse_hosts_file

SSH_CONFIG = """\
Host gpu1
  HostName 10.0.0.11
  User alice
  Port 2222
  IdentityFile ~/.ssh/id_cluster
  UserKnownHostsFile /etc/cluster_known_hosts
"""


def write(tmp_path: Path, text: str, config: str = SSH_CONFIG) -> tuple[Path, Path]:
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    cfg = tmp_path / "ssh_config"
    cfg.write_text(config)
    return hosts, cfg


def test_resolves_alias_through_ssh_config(tmp_path: Path) -> None:
    hosts, cfg = write(tmp_path, "# cluster\n\ngpu1 slots=8   # node 0\nbob@10.0.0.12:2200 slots=4 iface=ib0\n")
    first, second = parse_hosts_file(hosts, cfg)
    assert (first.name, first.hostname, first.port, first.user, first.slots) == ("gpu1", "10.0.0.11", 2222, "alice", 8)
    assert first.key_filenames[0].endswith("/.ssh/id_cluster")
    assert first.known_hosts_files == ("/etc/cluster_known_hosts",)
    assert first.source == f"{hosts}:3"
    assert (second.hostname, second.port, second.user, second.slots, second.iface) == ("10.0.0.12", 2200, "bob", 4, "ib0")


def test_deepspeed_form_and_per_host_keys(tmp_path: Path) -> None:
    hosts, cfg = write(tmp_path, "worker-1 slots=2 data_dir=/d/1 ckpt_dir=/c/{job} log_dir=/l "
                                 "docker_host=unix:///run/user/1000/docker.sock\n")
    (host,) = parse_hosts_file(hosts, cfg)
    assert host.slots == 2 and host.port == 22 and host.user is None
    assert (host.data_dir, host.ckpt_dir, host.log_dir) == ("/d/1", "/c/{job}", "/l")
    assert host.docker_host == "unix:///run/user/1000/docker.sock"


@pytest.mark.parametrize(("text", "message"), [
    ("", "lists no hosts"),
    ("# only a comment\n\n", "lists no hosts"),
    ("a\nb\na slots=2\n", ":3: duplicate host 'a' (already on"),
    ("gpu1\n10.0.0.11:2222\n", ":2: duplicate host"),  # same machine by alias and by address
    ("a slots=0\n", ":1: slots=0 must be between 1 and 1024"),
    ("a slots=100000000\n", ":1: slots=100000000 must be between 1 and 1024"),
    ("a slots=x\n", ":1: slots must be a whole number"),
    ("a gpus=2\n", ":1: unknown key 'gpus'"),
    ("a slots\n", ":1: expected key=value"),
    ("a slots=1 slots=2\n", "given twice"),
    ("a:99999\n", "port 99999 out of range"),
    ("a;touch /tmp/owned\n", "bad host name"),
    ("$(reboot)\n", "bad host name"),
    ("ev il@a\n", "expected key=value"),
    ("x`id`@a\n", "bad user name"),
    ("a data_dir=relative/dir\n", "data_dir must be an absolute path"),
    ("a iface=eth0;id\n", "bad iface value"),
    ("a docker_host=/var/run/docker.sock\n", "bad docker_host value"),
])
def test_bad_lines_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    hosts, cfg = write(tmp_path, text)
    with pytest.raises(HostsFileError) as info:
        parse_hosts_file(hosts, cfg)
    assert message in str(info.value)
    assert str(hosts) in str(info.value)


def test_a_hosts_file_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    hosts, cfg = write(tmp_path, "a\n")
    hosts.write_bytes(b"a\nb\xe9\n")  # Latin-1, as an old editor saves it
    with pytest.raises(HostsFileError, match=rf"^{hosts}:2: not UTF-8 text \(byte 0xe9\)"):
        parse_hosts_file(hosts, cfg)


def test_missing_file_and_missing_ssh_config(tmp_path: Path) -> None:
    with pytest.raises(HostsFileError, match="does not exist"):
        parse_hosts_file(tmp_path / "nope")
    hosts, _ = write(tmp_path, "a\n")
    with pytest.raises(HostsFileError, match="ssh config .* does not exist"):
        parse_hosts_file(hosts, tmp_path / "no_config")


def test_a_dry_run_runs_no_match_exec_command_of_the_ssh_config(tmp_path: Path) -> None:
    """paramiko runs `Match exec` commands while looking a host up; a dry run promises to run nothing."""
    import io

    from rich.console import Console

    from orchestrate import cli

    ran = tmp_path / "ran"
    (tmp_path / "ssh_config").write_text(f'Host gpu1\n  Port 2201\n\nMatch exec "touch {ran}"\n  User someone\n'
                                         "\nHost *\n  User ddp\n")
    (tmp_path / "hosts").write_text("gpu1\n")
    argv = ["up", "--hosts", str(tmp_path / "hosts"), "--ssh-config", str(tmp_path / "ssh_config"), "--gpus", "0"]
    out = io.StringIO()
    assert cli.run([*argv, "--dry-run"], Console(file=out, width=300)) == 0
    assert not ran.exists()
    assert f"Match exec at {tmp_path / 'ssh_config'}:4 not run" in out.getvalue()
    assert "on gpu1:2201" in out.getvalue()  # the other blocks still apply
    # A real launch evaluates it, as ssh would (in a child: invoke reads stdin, which pytest captures).
    code = f"from orchestrate.hosts import parse_hosts_file; parse_hosts_file({str(tmp_path / 'hosts')!r}, " \
           f"{str(tmp_path / 'ssh_config')!r})"
    subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, check=True, timeout=60)
    assert ran.exists()
