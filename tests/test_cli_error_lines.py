"""Every command line of the project answers bad input alike: one line that starts with `error:`, names the option
or file, and exit 2 (never argparse's `prog: error:` form with a usage block). The real programs, as a user runs
them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    "trainer": (["-m", "trainer", "--data-dir", "{tmp}", "--ckpt-dir", "{tmp}", "--bogus"],
                "unrecognized arguments: --bogus"),
    "trainer.data": (["-m", "trainer.data", "synth", "--out", "{tmp}", "--bogus"], "unrecognized arguments: --bogus"),
    "trainer.data without a command": (["-m", "trainer.data"], "the following arguments are required: cmd"),
    "trainer.plot": (["-m", "trainer.plot", "{tmp}/metrics.jsonl", "--bogus"], "unrecognized arguments: --bogus"),
    # The hint names the help of the command given (the top parser reports an option no command took).
    "orchestrate": (["-m", "orchestrate", "up", "--bogus"],
                    "unrecognized arguments: --bogus (see python -m orchestrate up --help)"),
    "orchestrate kill": (["-m", "orchestrate", "kill", "--grace", "x"],
                         "invalid float value: 'x' (see python -m orchestrate kill --help)"),
    "devcluster": (["-m", "devcluster", "up", "--hosts", "two"], "argument --hosts: invalid int value: 'two'"),
    # A value with a newline is echoed escaped: still one line.
    "trainer data dir with a newline": (["-m", "trainer", "--data-dir", "{tmp}/a\nb", "--ckpt-dir", "{tmp}/ck",
                                         "--device", "cpu"], "data dir {tmp}/a\\nb does not exist"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_and_exit_2(case: str, tmp_path: Path, repo_root: Path) -> None:
    argv, needle = CASES[case]
    env = {**os.environ, "PYTHONPATH": str(repo_root), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, *(a.replace("{tmp}", str(tmp_path)) for a in argv)], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().split("\n")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
