"""A skipped test fails the suite (tests/conftest.py's SkipsFail): pytest runs a tiny test file in a subprocess, with
tests/conftest.py loaded as a plugin, alone and under xdist as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SKIPPING = '''
import pytest

def test_runs() -> None:
    pass

def test_skips() -> None:
    pytest.skip("no reason here")
'''
MODULE_SKIP = 'import pytest\npytest.skip("module-level", allow_module_level=True)\n'


def _pytest(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {"PYTHONPATH": f"{TESTS}:{TESTS.parent}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", *args,
                           *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [(), ("-n", "2")], ids=["alone", "xdist"])
def test_a_skipped_test_or_module_fails_the_run(tmp_path: Path, args: tuple[str, ...]) -> None:
    run = _pytest(tmp_path, {"test_skipping.py": SKIPPING, "test_module_skip.py": MODULE_SKIP}, *args)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert "1 passed, 2 skipped" in run.stdout
    assert "error: 2 skipped (" in run.stdout and "test_skipping.py::test_skips" in run.stdout
    assert "test_module_skip.py" in run.stdout.split("error: 2 skipped", 1)[1]


def test_a_run_without_skips_passes(tmp_path: Path) -> None:
    run = _pytest(tmp_path, {"test_fine.py": "def test_fine() -> None:\n    pass\n"})
    assert run.returncode == pytest.ExitCode.OK, run.stdout + run.stderr
    assert "error:" not in run.stdout
