"""The test kit's own bounds (tests/kit): a wait that would hang ends with a message that says what it waited for."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from kit import orchestrate_kit
from kit.lines import LineReader

TESTS = Path(__file__).resolve().parent
PYTEST_TIMEOUT_S = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]


def test_a_line_that_never_comes_ends_the_wait_with_what_was_awaited() -> None:
    quiet = subprocess.Popen(["sh", "-c", "echo one; exec sleep 30"], stdout=subprocess.PIPE, text=True)
    try:
        lines = LineReader(quiet.stdout)
        assert lines.next(10, "the first line") == "one\n"
        with pytest.raises(AssertionError, match="^no line within 0 s while waiting for the second line$"):
            lines.next(0.2, "the second line")
        with pytest.raises(AssertionError, match=r"waiting for two lines; the last lines: \[\]$"):
            lines.until(lambda seen: len(seen) == 2, 0.2, "two lines")
    finally:
        quiet.kill()
        quiet.wait(timeout=10)
    assert lines.next(10, "the end") == ""


def test_a_wait_of_the_kit_ends_before_pytests_timeout_with_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that has spent its budget but 1 s: a wait of 600 s more ends in 1 s with its own message, where
    pytest's timeout (900 s) would have ended the test with a stack trace only."""
    monkeypatch.setattr(orchestrate_kit, "_test_began", [time.monotonic() - orchestrate_kit.TEST_BUDGET_S + 1])
    assert orchestrate_kit.TEST_BUDGET_S < PYTEST_TIMEOUT_S
    began = time.monotonic()
    with pytest.raises(AssertionError, match="^timed out after 1 s waiting for the job to finish$"):
        orchestrate_kit.wait_for(lambda: False, orchestrate_kit.PATIENCE, "the job to finish", every=0.1)
    assert time.monotonic() - began < 5


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/kit: a test module imported by another would run its tests' module-level
    code there, and pytest collects it once more under another name when both are in one folder's sys.path."""
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert found == []


def test_no_test_reads_a_line_without_a_bound() -> None:
    """A bare `readline()` on a program that prints nothing waits forever: tests read lines through kit.lines."""
    found = [f"{path.relative_to(TESTS)}:{n}" for path in sorted(TESTS.rglob("*.py")) if path.parent.name != "kit"
             and path.name != "test_kit.py" for n, line in enumerate(path.read_text().splitlines(), 1)
             if ".readline(" in line]
    assert found == []



def test_the_run_summary_counts_each_tier_and_names_the_slowest_tests(tmp_path: Path) -> None:
    """A run of unit, trainer and Slurm tests (one Slurm test made slow), under xdist as CI runs it, ends with the
    summary: two tests in each of those tiers, none in the others, the slow one first among the slowest."""
    for folder, name, body in (("orchestrate", "test_o.py", "pass"), ("trainer", "test_t.py", "pass"),
                               ("cluster", "test_slurm_x.py", "import time; time.sleep(0.5)")):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / name).write_text(f"def test_one():\n    {body}\n\ndef test_two():\n    pass\n")
    env = {"PYTHONPATH": f"{TESTS}:{TESTS.parent}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2",
                          "--rootdir", str(tmp_path), "--store-durations", "d.json", "tests"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {words[0]: words for words in map(str.split, run.stdout.splitlines()) if words[:1] in
            (["unit"], ["trainer"], ["image"], ["cluster"], ["slurm"])}
    assert {tier: int(words[1]) for tier, words in rows.items()} == {"unit": 2, "trainer": 2, "image": 0,
                                                                      "cluster": 0, "slurm": 2}
    slowest = run.stdout.split("slowest (seconds")[1].splitlines()[1].split()
    assert slowest[1:] == ["slurm", "tests/cluster/test_slurm_x.py::test_one"] and float(slowest[0]) >= 0.5
    stored = json.loads((tmp_path / "d.json").read_text())  # per module, the scheduler's tests/durations.json
    assert sorted(stored) == ["tests/cluster/test_slurm_x.py", "tests/orchestrate/test_o.py", "tests/trainer/test_t.py"]
    assert stored["tests/cluster/test_slurm_x.py"] >= 0.5
