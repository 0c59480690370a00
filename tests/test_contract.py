"""The contract between the trainer and the orchestrator is written once, in trainer/contract.py: no other module
of either side spells out one of its values (a file name, an environment variable, an exit code, a log line), so
a change there reaches both sides. Comments and docstrings may name them; code may not. Needs nothing."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrate.watch import health
from trainer import contract, metrics, straggler

REPO = Path(__file__).resolve().parents[1]
SIDES = ("trainer", "orchestrate")
# The same spelling for another thing: (module, contract name) -> what it is there.
NOT_THE_CONTRACT = {("orchestrate/backends/docker_ssh/layercache.py", "SHARDED_MANIFEST"): "the manifest.json of a `docker save` archive",
                    **{(module, "TENSORBOARD_FOLDER"): "the `tensorboard` subcommand, TensorBoard's package and CLI"
                       for module in ("orchestrate/cli.py", "orchestrate/config.py", "orchestrate/jobs/commands.py",
                                      "orchestrate/jobs/tensorboard.py")}}


def contract_strings() -> dict[str, str]:
    """Every string the contract names (its upper-case constants, the CIFAR-10 files), by name."""
    values = {name: value for name, value in vars(contract).items() if name.isupper() and isinstance(value, str)}
    values |= {f"ALL_FILES[{name}]": name for name, _ in contract.ALL_FILES}
    values |= {f"ALL_FILES[{name}].md5": md5 for name, md5 in contract.ALL_FILES}
    values["stack_file_name"] = contract.stack_file_name(7).split("7")[0]
    return values


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings or bare comment strings (an expression statement)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def code_constants(path: Path) -> Iterator[tuple[int, str | int]]:
    """(line, value) of every string and integer constant the module's code holds (f-string parts included),
    and every keyword argument's name."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    found: list[tuple[int, str | int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skip and isinstance(node.value, str | int):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg is not None:  # env.update(DDP_RESTART=...) names a key too
            found.append((node.lineno, node.arg))
    yield from sorted(found, key=lambda item: item[0])


def _word(value: str) -> re.Pattern[str]:
    """A value as a whole word: `RESUME` in "RESUME=1", never in "--resume" or "DDP_RESUME"."""
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(value)}(?![A-Za-z0-9_])")


def sources() -> list[Path]:
    files = [p for side in SIDES for p in sorted((REPO / side).rglob("*.py"))]
    return [p for p in files if p != REPO / "trainer" / "contract.py"]


def spelled_out(values: dict[str, str], exit_codes: dict[str, int], files: list[Path], root: Path) -> list[str]:
    patterns = {name: _word(value) for name, value in values.items()}
    found = []
    for path in files:
        module = path.relative_to(root).as_posix()
        for line, constant in code_constants(path):
            where = f"{module}:{line}"
            if isinstance(constant, str):
                found += [f"{where}: {name} {values[name]!r}" for name, p in patterns.items()
                          if p.search(constant) and (module, name) not in NOT_THE_CONTRACT]
            elif not isinstance(constant, bool):
                found += [f"{where}: {name} {value}" for name, value in exit_codes.items() if constant == value]
    return found


def test_no_module_of_either_side_spells_out_a_contract_value() -> None:
    found = spelled_out(contract_strings(), {"EXIT_STOPPED": contract.EXIT_STOPPED}, sources(), REPO)
    assert not found, "use trainer.contract's names instead:\n" + "\n".join(found)


def test_the_check_finds_a_copy(tmp_path: Path) -> None:
    """The check itself: a module that writes the heartbeat's name, an env variable or the exit code is caught,
    one that only documents them is not."""
    copy = tmp_path / "copy.py"
    copy.write_text('"""Writes heartbeat.json and reads DDP_RESTART."""\n'
                    'NAME = f"{1}/heartbeat.json"\nENV = {"DDP_RESTART": 1}\nCODE = 143\nOK = "--resume"\n'
                    'dict(RESUME="1")\n')
    found = spelled_out(contract_strings(), {"EXIT_STOPPED": contract.EXIT_STOPPED}, [copy], tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "HEARTBEAT_FILE 'heartbeat.json'", "ENV_RESTART 'DDP_RESTART'", "EXIT_STOPPED 143", "ENV_RESUME 'RESUME'"]


@pytest.fixture
def example_ckpt(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import example_ckpt

    yield example_ckpt
    sys.modules.pop("example_ckpt", None)


def test_the_examples_copy_of_the_contract_agrees(example_ckpt: object) -> None:
    """examples/example_ckpt.py is for users to copy into their own programs, so it keeps its own spelling of
    the contract (it cannot import the trainer): it must be the same."""
    assert example_ckpt.EXIT_STOPPED == contract.EXIT_STOPPED  # type: ignore[attr-defined]
    assert example_ckpt.MANIFEST_RE.fullmatch(contract.manifest_name(120))  # type: ignore[attr-defined]
    assert not example_ckpt.MANIFEST_RE.fullmatch(contract.pt_name(120))  # type: ignore[attr-defined]


def test_the_trainers_heartbeat_reads_back_whole_on_the_orchestrators_side(tmp_path: Path) -> None:
    """Writer and reader share contract.Beat: every field the trainer writes comes back typed."""
    beat = metrics.Heartbeat(tmp_path, enabled=True, total_steps=600, epochs=15, global_batch=256)
    beat.mark("checkpointing", step=120, epoch=3, loss=1.25, images_per_s=412.0, ckpt_step=96)
    read = health.Beat.parse((tmp_path / contract.HEARTBEAT_FILE).read_text())
    assert read is not None and read.time is not None
    assert (read.state, read.step, read.total_steps, read.epoch, read.epochs, read.loss, read.images_per_s,
            read.ckpt_step) == ("checkpointing", 120, 600, 3, 15, 1.25, 412.0, 96)
    assert read.progress_line() == "step 120/600 (20%) epoch 3/15 loss 1.250 412 img/s checkpointing"


def test_the_slow_stage_the_trainer_writes_is_the_one_up_and_status_name(tmp_path: Path) -> None:
    """--pp 2 x dp 1 on 2 nodes: each rank's stage rides in the heartbeat (contract.Beat.rank_stage), and the
    orchestrator's line (up's progress, status) says which stage holds the pipeline back, then where it runs."""
    beat = metrics.Heartbeat(tmp_path, enabled=True, total_steps=600, epochs=15, global_batch=256)
    for _ in range(straggler.STRAGGLER_WINDOWS):
        beat.ranks([(0.3, 0.1, 0.0), (0.3, 0.2, 0.0)], 1, (0, 1))
    beat.mark("training", step=24)
    read = health.Beat.parse((tmp_path / contract.HEARTBEAT_FILE).read_text())
    assert read is not None and read.rank_stage == (0, 1)
    assert read.straggler_line() == "slowest: stage 1 (node 1 rank 1), 1.3x the median step"


def test_a_heartbeat_field_the_contract_does_not_name_is_refused(tmp_path: Path) -> None:
    """A misspelled field would be written and never read: the writer refuses it."""
    beat = metrics.Heartbeat(tmp_path, enabled=True, total_steps=600, epochs=15, global_batch=256)
    with pytest.raises(TypeError):
        beat.mark("checkpointing", ckpt_stpe=96)
