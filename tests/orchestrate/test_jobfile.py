"""Job files (`up -f job.toml`): the up parser is their schema; the command line wins; the stored job resumes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from orchestrate import cli, jobfile
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError
from orchestrate.jobs.memory import remember


def hosts_file(tmp_path: Path) -> Path:
    path = tmp_path / "hosts.txt"
    path.write_text("10.0.0.11 slots=2\n10.0.0.12 slots=2\n")
    return path


def parse(*argv: str) -> UpConfig:
    command, config = cli.parse_args(list(argv))
    assert command == "up" and isinstance(config, UpConfig)
    return config


def test_every_option_round_trips_through_a_job_file(tmp_path: Path) -> None:
    hosts = hosts_file(tmp_path)
    original = parse("up", "--hosts", str(hosts), "--job", "r18", "--image", "reg:5000/img:2", "--gpus", "4",
                     "--nproc-per-node", "2", "--master-port", "29600", "--data-dir", "/data/c", "--ckpt-dir",
                     "/ck/{job}", "--log-dir", "/lg", "--env", "A=1", "--env", "B=x y", "--pull", "--layer-cache", "off", "--timings",
                     "--replace", "--stop-on-interrupt", "--min-free-gb", "2.5", "--shm-size", "16g", "--grace", "5",
                     "--max-restarts", "3", "--min-nodes", "1", "--stall-timeout", "60", "--ckpt-mirror",
                     str(tmp_path / "mirror"), "--check-network", "--check-max-mb", "64", "--entry", "-m app.train",
                     "--", "--lr", "0.1", "x y")
    text = jobfile.of_config(original)
    (tmp_path / "job.toml").write_text(text)
    again = parse("up", "-f", str(tmp_path / "job.toml"))
    assert again == original, text
    assert again.with_options(timings=False) != original  # the comparison is not vacuous


@pytest.mark.parametrize(("content", "line", "message"), [
    ('job = "a"\ngpus = 2\nmax_restart = 3\n', 3, "unknown key 'max_restart'"),
    ('job = "a"\n\ngrace = "soon"\n', 3, "grace = 'soon': could not convert"),
    ('gpus = "x"\n', 1, "gpus = 'x': --gpus 'x': give a number of GPUs per node"),
    ('pull = "yes"\n', 1, "pull = 'yes': write true or false"),
    ('args = "--epochs 3"\n', 1, "args must be a list of strings"),
    ('env = 3\n', 1, "env must be a table"),
])
def test_a_bad_key_or_value_names_the_file_and_the_line(tmp_path: Path, content: str, line: int,
                                                         message: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f'hosts = "{hosts_file(tmp_path)}"\n' + content)
    with pytest.raises(ConfigError) as info:
        parse("up", "-f", str(path))
    assert str(info.value).startswith(f"{path}:{line + 1}: ") and message in str(info.value), str(info.value)


def test_the_command_line_wins_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    hosts_file(tmp_path)
    (tmp_path / "job.toml").write_text('hosts = "hosts.txt"\njob = "a"\ngpus = 8\nargs = ["--epochs", "3"]\n'
                                       'env = { NCCL_DEBUG = "WARN" }\n')
    from_file = parse("up", "-f", str(tmp_path / "job.toml"))
    assert from_file.ssh.hosts_file == tmp_path / "hosts.txt" and from_file.resources.gpus == 8
    assert from_file.program.trainer_args == ("--epochs", "3") and from_file.program.env == (("NCCL_DEBUG", "WARN"),)
    mixed = parse("up", "-f", str(tmp_path / "job.toml"), "--job", "b", "--gpus", "0", "--", "--epochs", "5")
    assert (mixed.program.job, mixed.resources.gpus, mixed.program.trainer_args) == ("b", 0, ("--epochs", "5"))


def test_dry_run_prints_the_merged_job_then_the_plan(tmp_path: Path) -> None:
    hosts = hosts_file(tmp_path)
    (tmp_path / "job.toml").write_text(f'hosts = "{hosts}"\njob = "a"\ngpus = 0\nenv = {{ HF_TOKEN = "s3cr3t" }}\n')
    out = io.StringIO()
    rc = cli.run(["up", "-f", str(tmp_path / "job.toml"), "--job", "b", "--dry-run", "--", "--epochs", "2",
                  "--model", "s3cr3t"], Console(file=out, width=400))
    text = out.getvalue()
    assert rc == 0 and '#   job = "b"' in text and '#   env = ["HF_TOKEN=****"]' in text and "s3cr3t" not in text
    assert '#   args = ["--epochs", "2", "--model", "****"]' in text and "--name b-node0" in text


def test_resume_by_job_name_needs_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = parse("up", "--hosts", str(hosts_file(tmp_path)), "--job", "r18", "--gpus", "0", "--max-restarts", "2",
                  "--", "--epochs", "30")
    remember(first)
    resumed = parse("up", "--resume", "--job", "r18")
    assert resumed == first.with_options(resume=True)
    with pytest.raises(ConfigError, match="up needs the hosts"):
        parse("up", "--job", "never-ran")


def test_the_command_lines_defaults_are_the_configs(tmp_path: Path) -> None:
    """One place for defaults: an `up` with no options is the config with its own defaults."""
    hosts = hosts_file(tmp_path)
    from orchestrate.config import JobsConfig, SSHOptions

    assert parse("up", "--hosts", str(hosts)) == UpConfig.of(ssh=SSHOptions(hosts, None, False))
    assert cli.parse_args(["kill"])[1] == JobsConfig(ssh=SSHOptions(None, None, False))


def test_a_password_in_the_data_url_is_neither_stored_nor_printed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    url = "https://alice:pa55word@data.example/cifar-10-python.tar.gz"
    argv = ["up", "--hosts", str(hosts_file(tmp_path)), "--job", "u", "--gpus", "0", "--data-url", url]
    path = remember(parse(*argv))
    assert "pa55word" not in path.read_text() and "https://****@data.example/" in path.read_text()
    out = io.StringIO()
    assert cli.run([*argv, "--dry-run"], Console(file=out, width=400)) == 0
    assert "pa55word" not in out.getvalue() and "****@data.example" in out.getvalue()
