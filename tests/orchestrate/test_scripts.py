"""The scripts run in containers (orchestrate/remote/scripts/), run here for real with sh and this Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrate.probe.imagecheck import CHECK_IMAGE, FIND_PYTHON, parse_facts
from orchestrate.remote import scripts


def _check(kind: str, target: str, path: str) -> str:
    res = subprocess.run(["sh", "-c", FIND_PYTHON, "check", CHECK_IMAGE, kind, target], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PATH": path})
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_image_check_finds_python_torch_and_the_entry(tmp_path: Path) -> None:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    facts = parse_facts(_check("module", "json", path))
    assert facts.python and facts.torch and facts.entry
    assert not parse_facts(_check("script", str(tmp_path / "absent.py"), path)).entry
    assert not parse_facts(_check("module", "no_such_module_here", path)).entry


def test_image_check_target_never_becomes_code(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    out = _check("script", f"$(touch {planted})'; touch {planted}; '", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert not parse_facts(out).entry and not planted.exists()


def test_image_without_python_says_so(tmp_path: Path) -> None:
    (tmp_path / "sh").symlink_to("/bin/sh")
    res = subprocess.run(["/bin/sh", "-c", FIND_PYTHON, "check", CHECK_IMAGE, "module", "json"], capture_output=True,
                         text=True, timeout=60, env={"PATH": str(tmp_path)})
    assert parse_facts(res.stdout).python is None


def test_signal_ranks_signals_only_rank_processes(tmp_path: Path) -> None:
    """In a PID namespace of its own (its own /proc): SIGUSR1 must never reach the machine's other processes."""
    got = tmp_path / "got"
    # The stand-in rank writes a file on SIGUSR1; the stand-in torchrun (no RANK) would die of it.
    rank = (f"import signal, pathlib, time\nsignal.signal(signal.SIGUSR1, lambda *a: pathlib.Path({str(got)!r})"
            ".write_text('1'))\nprint('ready', flush=True)\nfor _ in range(600):\n    time.sleep(0.05)\n")
    inner = ("RANK=3 LOCAL_RANK=1 \"$1\" -c \"$2\" > \"$3\" & "
             "for _ in $(seq 100); do [ -s \"$3\" ] && break; sleep 0.1; done; "
             "\"$1\" -c \"$4\"; for _ in $(seq 100); do [ -s \"$5\" ] && break; sleep 0.1; done; kill $!")
    res = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", inner, "sh", sys.executable,
                          rank, str(tmp_path / "ready"), scripts.text("signal_ranks.py"), str(got)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert list(json.loads(res.stdout.splitlines()[-1])) == ["3"]
    assert got.read_text() == "1"
