"""`up --entry`: the plan for any torchrun program (command, env contract, per-rank log files), the image
check's verdicts, and `logs --rank`'s rank arithmetic. Pure: nothing is contacted."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shlex
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from kit.units import SSH, job_specs
from rich.console import Console

from orchestrate import cli
from orchestrate.backends.docker_ssh.control import NEWEST_RUN, _runs_trainer, locate_rank, rank_files
from orchestrate.backends.docker_ssh.observe import run_check
from orchestrate.config import JobsConfig, UpConfig
from orchestrate.errors import ConfigError, PreflightError
from orchestrate.hosts import Host
from orchestrate.probe import imagecheck as entry
from orchestrate.probe.imagecheck import ImageFacts, judge, parse_facts
from orchestrate.probe.observations import Launcher

HOSTS = [Host(name="a", hostname="10.0.0.1", port=22, user="u", slots=2),
         Host(name="b", hostname="10.0.0.2", port=22, user="u", slots=2)]
LOG_ARGS = ["--log-dir", "/logs", "--redirects", "3", "--tee", "3"]


def config(**kw: object) -> UpConfig:
    return UpConfig.of(ssh=SSH, job="byo", image="ex:1", gpus=0, **kw)  # type: ignore[arg-type]


def after_torchrun_options(command: tuple[str, ...]) -> list[str]:
    """The words after torchrun's own options (which end with the log flags)."""
    return list(command[command.index("--tee") + 2:])


def test_script_entry_gets_its_arguments_untouched_and_no_trainer_options() -> None:
    specs = job_specs(config(entry="/app/train.py", trainer_args=("--steps", "5", "--whatever")), HOSTS, "10.0.0.1")
    for spec in specs:
        assert after_torchrun_options(spec.command) == ["/app/train.py", "--steps", "5", "--whatever"]
        assert spec.command[0] == "torchrun"


def test_module_entry_and_resume_by_environment_only() -> None:
    spec = job_specs(config(entry="-m pkg.train", resume=True), HOSTS, "10.0.0.1")[1]
    assert after_torchrun_options(spec.command) == ["-m", "pkg.train"]  # no --resume: RESUME=1 says it
    assert spec.env["RESUME"] == "1"


def test_env_contract_and_mounts_for_every_node() -> None:
    for spec in job_specs(config(entry="/app/train.py"), HOSTS, "10.0.0.1"):
        assert {k: spec.env[k] for k in ("DATA_DIR", "CKPT_DIR", "LOG_DIR")} == \
            {"DATA_DIR": "/data", "CKPT_DIR": "/checkpoints", "LOG_DIR": "/logs"}
        assert "RESUME" not in spec.env  # a fresh start says nothing
        assert {m.target for m in spec.mounts} == {"/data", "/checkpoints", "/logs"}


def test_torchrun_writes_per_rank_files_into_the_log_mount() -> None:
    command = job_specs(config(), HOSTS, "10.0.0.1")[0].command
    i = command.index("--log-dir")
    assert list(command[i:i + 6]) == LOG_ARGS
    assert command.index("--log-dir") < command.index("-m")  # torchrun's option, not the program's


def test_trainer_stays_the_default_entry_with_its_options() -> None:
    spec = job_specs(config(resume=True, trainer_args=("--epochs", "2")), HOSTS, "10.0.0.1")[0]
    assert after_torchrun_options(spec.command) == ["-m", "trainer", "--data-dir", "/data", "--ckpt-dir",
                                                    "/checkpoints", "--epochs", "2", "--resume"]


def test_trainer_options_are_checked_only_when_the_trainer_is_the_entry() -> None:
    with pytest.raises(ConfigError, match="unrecognized arguments: --steps"):
        config(trainer_args=("--steps", "5"))
    config(entry="/app/train.py", trainer_args=("--steps", "5", "--data-dir", "x"))  # its own business


@pytest.mark.parametrize("entry", ["", "-m", "-m 9bad", "-m pkg train", "/app/my train.py", "--steps"])
def test_bad_entry_is_refused(entry: str) -> None:
    with pytest.raises(ConfigError, match="--entry"):
        config(entry=entry)


def test_launcher_without_torchrun_on_path() -> None:
    spec = job_specs(config(entry="/app/t.py"), HOSTS, "10.0.0.1", launcher=("/usr/bin/python3", "-m",
                                                                             "torch.distributed.run"))[0]
    assert spec.command[:4] == ("/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes")


def test_dry_run_shows_entry_env_and_log_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    code = cli.run(["up", "--dry-run", "--hosts", str(hosts), "--gpus", "0", "--image", "ex:1", "--resume",
                    "--entry", "-m pkg.train", "--", "--steps", "3"], Console(width=1000))
    lines = [shlex.split(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("docker run")]
    assert code == 0 and len(lines) == 2
    for argv in lines:
        assert argv[-4:] == ["-m", "pkg.train", "--steps", "3"]
        assert argv[argv.index("--log-dir"):][:6] == LOG_ARGS
        assert {"--env=RESUME=1", "--env=DATA_DIR=/data", "--env=CKPT_DIR=/checkpoints", "--env=LOG_DIR=/logs"} \
            <= set(argv)


def test_dry_run_refuses_a_bad_entry_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a\n")
    assert cli.main(["up", "--dry-run", "--hosts", str(hosts), "--entry", "train me.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --entry")


# ---- the image check's verdicts --------------------------------------------------------------------


def facts(**kw: object) -> ImageFacts:
    base = dict(python="/usr/bin/python", torch="2.13.0", torchrun="/usr/bin/torchrun", entry=True)
    return ImageFacts(**{**base, **kw})  # type: ignore[arg-type]


def test_image_with_torchrun_launches_with_torchrun() -> None:
    assert judge(facts(), config(entry="/app/t.py").program) == Launcher(("torchrun",), None)


def test_image_without_torchrun_on_path_uses_its_python() -> None:
    assert judge(facts(torchrun=None), config().program) == Launcher(("/usr/bin/python", "-m", "torch.distributed.run"))


def test_an_image_with_trainer_launch_offers_it_for_one_process_a_node() -> None:
    assert judge(facts(one_process=True), config().program) == \
        Launcher(("torchrun",), ("/usr/bin/python", "-m", "trainer.launch"))


@pytest.mark.parametrize(("kw", "says"), [
    ({"python": None}, "has no python"),
    ({"torch": None}, "has no torch"),
    ({"entry": False}, "lacks the entry: script '/app/t.py' is not a file"),
])
def test_unusable_image_is_refused_in_one_line(kw: dict[str, object], says: str) -> None:
    with pytest.raises(PreflightError) as err:
        judge(facts(**kw), config(entry="/app/t.py").program)
    assert says in str(err.value) and "nothing was started" in str(err.value) and "\n" not in str(err.value)


def test_missing_module_names_the_module_and_why() -> None:
    with pytest.raises(PreflightError, match=r"module 'pkg.train' is not importable \(ModuleNotFoundError"):
        judge(facts(entry=False, entry_error="ModuleNotFoundError: no pkg"), config(entry="-m pkg.train").program)


def test_check_output_parsing() -> None:
    assert parse_facts('noise\n{"python": "/p", "torch": "2.13.0", "torchrun": null, "entry": true}\n') == \
        ImageFacts("/p", "2.13.0", None, True)
    assert parse_facts('{"python": "/p", "torch": "2", "torchrun": null, "entry": true, "one_process": true}').one_process
    assert parse_facts("sh: exec: not found\n").python is None  # garbled: judged as no python


# ---- logs --rank -----------------------------------------------------------------------------------


def test_the_newest_run_folder_is_a_run_not_the_trainers_newer_files(tmp_path: Path) -> None:
    """The trainer writes stack-rank<R>.txt and tensorboard/ into the log folder after its launcher made the run
    folder: `logs --rank` of a trainer job read the stack file as the run and found no log files (seen in a
    walk-through of README's commands)."""
    def newest() -> str:
        return subprocess.run(["sh", "-c", NEWEST_RUN, "newest", str(tmp_path)], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    assert newest() == ""  # no run yet
    for i, run in enumerate(["none_old", "none_new"]):
        (tmp_path / run / "attempt_0" / "0").mkdir(parents=True)
        os.utime(tmp_path / run / "attempt_0", (1000 + i, 1000 + i))
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "stack-rank1.txt").write_text("")
    assert newest() == "none_new"


def test_global_rank_to_node_and_local_rank() -> None:
    nodes = [(1, 3), (0, 2)]  # node rank, processes: ranks 0-1 on node 0, 2-4 on node 1
    assert [locate_rank(nodes, r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), None]


def test_rank_option_is_validated() -> None:
    assert JobsConfig(ssh=SSH, rank=1).rank == 1 and JobsConfig(ssh=SSH, rank=1, follow=True).follow
    for bad in ({"rank": -1}, {"rank": 0, "node": 0}):
        with pytest.raises(ConfigError, match="--rank"):
            JobsConfig(ssh=SSH, **bad)  # type: ignore[arg-type]


def test_status_knows_which_containers_run_the_trainer() -> None:
    def container(cmd: list[str]) -> SimpleNamespace:
        return SimpleNamespace(attrs={"Config": {"Cmd": cmd}})

    assert _runs_trainer(container(["torchrun", "--nnodes", "2", "-m", "trainer", "--epochs", "1"]))
    assert not _runs_trainer(container(["torchrun", "--nnodes", "2", "/app/trainer"]))
    assert not _runs_trainer(container(["torchrun", "-m", "charlm.train", "--x", "trainer"]))
    assert _runs_trainer(container(["python3", "-m", "trainer.launch", "--nnodes", "2", "-m", "trainer"]))
    assert not _runs_trainer(container(["python3", "-m", "trainer.launch", "--nnodes", "2", "-m", "charlm.train"]))


def test_rank_files_takes_the_newest_attempt_of_one_local_rank() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in (("r_x/attempt_0/1/stdout.log", "old one"), ("r_x/attempt_1/1/stdout.log", "new one"),
                           ("r_x/attempt_1/1/stderr.log", "new err"), ("r_x/attempt_1/0/stdout.log", "rank zero"),
                           ("r_x/attempt_1/10/stdout.log", "local ten")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    assert rank_files(buf.getvalue(), 1) == {"stdout": "new one", "stderr": "new err"}
    assert rank_files(buf.getvalue(), 2) == {}


class CheckClient:
    """A docker client whose check container answers `facts`; counts the containers run."""

    def __init__(self, answer: ImageFacts) -> None:
        self.runs = 0
        self.answer = answer
        self.containers = SimpleNamespace(run=self._run)

    def _run(self, *args: object, **kwargs: object) -> bytes:
        self.runs += 1
        return (json.dumps(dataclasses.asdict(self.answer)) + "\n").encode()

    def check(self) -> str:
        """The check run on this client, as the scheduler runs it (backends/docker_ssh/observe.py)."""
        return run_check(self, "ex:1", {})


def test_a_passed_check_is_remembered_by_image_id_and_entry_only(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    client = CheckClient(facts(torchrun=None, one_process=True))
    launcher = Launcher(("/usr/bin/python", "-m", "torch.distributed.run"), ("/usr/bin/python", "-m", "trainer.launch"))
    for image_id, entry_arg, runs in [("sha256:aa", "/app/t.py", 1), ("sha256:aa", "/app/t.py", 1),
                                      ("sha256:aa", "-m pkg.t", 2), ("sha256:bb", "/app/t.py", 3),
                                      (None, "/app/t.py", 4), (None, "/app/t.py", 5)]:
        assert entry.check_image(config(entry=entry_arg).program, image_id, client.check) == launcher  # remembered too
        assert client.runs == runs, (image_id, entry_arg)
    for memo in (tmp_path / "ddp-cifar" / "image-checks").iterdir():
        memo.write_text("{garbage")  # a damaged memory: the check runs again
    entry.check_image(config(entry="/app/t.py").program, "sha256:aa", client.check)
    assert client.runs == 6


def test_a_refused_image_is_checked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    client = CheckClient(facts(entry=False))
    for runs in (1, 2):
        with pytest.raises(PreflightError, match="lacks the entry"):
            entry.check_image(config(entry="/app/t.py").program, "sha256:aa", client.check)
        assert client.runs == runs


def test_a_memo_of_an_older_check_is_not_an_answer_to_the_new_questions(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A memo written before the check asked for trainer.launch (its key without MEMO_VERSION) would keep torchrun
    on an unchanged image after an upgrade: the check runs again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    program = config(entry="/app/t.py").program
    old_key = hashlib.sha256("\0".join(("sha256:aa", *program.entry_target)).encode()).hexdigest()[:32]
    old = tmp_path / "ddp-cifar" / "image-checks" / f"{old_key}.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({k: v for k, v in dataclasses.asdict(facts()).items() if k != "one_process"}))
    client = CheckClient(facts(one_process=True))
    assert entry.check_image(program, "sha256:aa", client.check).one_process == ("/usr/bin/python", "-m", "trainer.launch")
    assert client.runs == 1


def test_a_cache_that_cannot_be_written_costs_the_check_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ddp-cifar").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    client = CheckClient(facts())
    for runs in (1, 2):
        assert entry.check_image(config(entry="/app/t.py").program, "sha256:aa", client.check) == Launcher()
        assert client.runs == runs
