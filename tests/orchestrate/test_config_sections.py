"""UpConfig in sections, each option declared once: the command line is built from the fields' metadata."""

from __future__ import annotations

import argparse
import dataclasses
import io
from pathlib import Path

import pytest
from kit.units import SSH, parse
from rich.console import Console

from orchestrate import cli
from orchestrate.api import Job
from orchestrate.backends.slurm import submit
from orchestrate.config import JOB_COMMANDS, SECTIONS, JobsConfig, SSHOptions, UpConfig
from orchestrate.errors import ConfigError

NOT_FIELDS = {"help", "hosts", "ssh_config", "accept_new_host_keys", "file", "trainer_args"}


def test_every_up_option_is_one_field_and_the_parsers_defaults_are_the_fields() -> None:
    up = cli.build_parser().up_parser  # type: ignore[attr-defined]
    dests = {a.dest for a in up._actions} - NOT_FIELDS  # noqa: SLF001 - argparse's schema
    flags = {f.metadata["flag"].lstrip("-").replace("-", "_") for cls in SECTIONS.values()
             for f in dataclasses.fields(cls) if f.metadata.get("flag")}
    assert dests == flags and len(dests) == 37  # 38 before --gpus-on-cpu became the devcluster's setting
    # The command line with no option is the config with none: every default is the field's own.
    assert dataclasses.replace(parse(), ssh=SSH) == UpConfig.of(SSH)
    assert parse("--gpus", "4-5", "--dry-run=hosts", "--json", "--env", "A=1").options() == UpConfig.of(
        SSH, gpus=2, gpu_ids=(4, 5), dry_run_hosts=True, as_json=True, env=(("A", "1"),)).options()


def test_options_go_to_their_section_and_a_changed_copy_is_checked_again() -> None:
    job = Job("hosts.txt", gpus=0, max_restarts=2, check_network=True, entry="/app/t.py")
    assert (job.resources.gpus, job.resilience.max_restarts, job.checks.check_network) == (0, 2, True)
    assert job.program.entry_target == ("script", "/app/t.py") and job.options()["max_restarts"] == 2
    assert job.with_options(min_nodes=1).resilience.min_nodes == 1
    with pytest.raises(ConfigError, match="--min-nodes applies at automatic restarts"):
        job.with_options(max_restarts=0, min_nodes=1)
    with pytest.raises(TypeError, match="'gpu'"):
        Job("hosts.txt", gpu=1)


def test_help_shows_a_default_once_and_never_none() -> None:
    """argparse's default-showing formatter appended "(default: None)" to every option without a default, and a
    second default to options whose help already says theirs in words (--hosts, submit's --partition)."""
    parser = cli.build_parser()
    texts = [parser.up_parser.format_help(), submit.parser(cli.COMMAND_LINE).format_help()]  # type: ignore[attr-defined]
    for text in texts:
        flat = " ".join(text.split())
        assert "(default: None)" not in flat and "(default: False)" not in flat
        assert "(default: Slurm's default) (default" not in flat
    assert "(default: 60.0)" in " ".join(texts[0].split())  # --grace: a real default is still shown


def test_the_top_help_lists_every_command_a_scheduler_adds_and_its_own_help_still_answers(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m orchestrate --help` lists `submit` beside `up` (it showed it only in an example), and
    `submit --help` is still submit's own parser, with its options."""
    top = " ".join(cli.build_parser().format_help().split())
    assert "submit queue the job with Slurm (sbatch) and return" in top, top
    with pytest.raises(SystemExit):
        cli.run(["submit", "--help"], Console(file=io.StringIO()))
    assert "--gpus-per-node" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["up", "kill", "status", "logs"])
def test_only_up_says_the_allocation_it_runs_in_is_its_default_hosts(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Inside an allocation up takes its nodes without --hosts; the job commands take the job's last up's hosts
    file (their help said the allocation too)."""
    with pytest.raises(SystemExit):
        cli.run([command, "--help"], Console(file=io.StringIO()))
    text = " ".join(capsys.readouterr().out.split())
    assert ("(default: slurm inside an allocation, else" in text) == (command == "up"), text


def test_each_job_commands_options_are_the_jobs_config_fields_naming_it() -> None:
    """kill, status, logs, plot, tensorboard: each option declared once, as a JobsConfig field whose metadata names
    the commands that take it; the parser's dest, default and help are the field's, and the parsed value lands
    there (an option absent from a command keeps the field's default)."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices  # noqa: SLF001
    ssh = {"help", "hosts", "ssh_config", "accept_new_host_keys"}
    taken: dict[str, set[str]] = {}
    for command in JOB_COMMANDS:
        actions = {a.dest: a for a in commands[command]._actions if a.dest not in ssh}  # noqa: SLF001
        declared = {f.name: f for f in dataclasses.fields(JobsConfig) if command in f.metadata.get("commands", ())}
        assert set(actions) == set(declared), command
        for name, f in declared.items():
            helps = f.metadata["commands"]
            assert actions[name].default == f.default
            assert actions[name].help == (helps[command] if isinstance(helps, dict) else f.metadata["help"])
        taken[command] = set(actions)
    assert taken == {"kill": {"job", "grace"}, "status": {"job", "all_jobs"},
                     "logs": {"job", "follow", "node", "tail", "rank"}, "plot": {"job", "out"},
                     "tensorboard": {"job", "out", "port"}}
    ssh_options = SSHOptions(None, None, False)  # no --hosts: the job's memory names them later
    assert cli.parse_args(["logs", "-f", "--node", "1", "--tail", "0", "--job", "j"])[1] == JobsConfig(
        ssh=ssh_options, job="j", follow=True, node=1, tail=0)
    assert cli.parse_args(["tensorboard", "--out", "d", "--port", "7000"])[1] == JobsConfig(
        ssh=ssh_options, out=Path("d"), port=7000)
    assert cli.parse_args(["status", "--all"])[1] == JobsConfig(ssh=ssh_options, all_jobs=True)
    with pytest.raises(ConfigError, match="unrecognized arguments: --tail"):
        cli.parse_args(["kill", "--tail", "3"])
