"""The scripts run in containers (orchestrate/remote/scripts/), run here for real with sh and this Python."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from orchestrate.backends.docker_ssh import data as prefetch
from orchestrate.backends.docker_ssh.datacopy import BATCHES, MARKER
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


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def _hostile_members(outside: Path) -> dict[str, list[tarfile.TarInfo]]:
    """Each a list: members extracted in that order (a link, then a file written through it)."""
    return {
        "dot-dot": [_member("../escaped")],
        "absolute": [_member(str(outside / "absolute"))],
        "symlink out": [_member("out", tarfile.SYMTYPE, str(outside))],
        "relative symlink out": [_member(f"{BATCHES}/up", tarfile.SYMTYPE, "../../outside")],
        "through a symlink": [_member("inner", tarfile.SYMTYPE, "."), _member("inner/../../escaped")],
        "hard link out": [_member("hard", tarfile.LNKTYPE, "../outside/victim")],
        "device": [_member("null", tarfile.CHRTYPE)],
        "fifo": [_member("pipe", tarfile.FIFOTYPE)],
    }


@pytest.mark.parametrize("filtered", [False, True], ids=["fallback", "data filter"])
@pytest.mark.parametrize("case", list(_hostile_members(Path("/x"))))
def test_a_hostile_archive_is_refused_with_or_without_tarfiles_data_filter(tmp_path: Path, case: str,
                                                                           filtered: bool) -> None:
    """The md5 matched (the archive was sent or downloaded as given), yet no member is written outside the data
    folder, nor a device made: the fallback for a Python without the data filter checks what the filter does (an
    absolute name it refuses, where the filter strips its leading slash)."""
    outside, data = tmp_path / "outside", tmp_path / "data"
    outside.mkdir()
    data.mkdir()
    (outside / "victim").write_text("keep")
    members = _hostile_members(outside)[case]
    path = data / prefetch.ARCHIVE
    with tarfile.open(path, "w:gz") as tar:
        good = tarfile.TarInfo(f"{BATCHES}/data_batch_1")
        good.size = 1
        tar.addfile(good, io.BytesIO(b"1"))
        for m in members:
            m.size = 1 if m.isfile() else 0
            tar.addfile(m, io.BytesIO(b"x") if m.isfile() else None)
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    code = prefetch.SCRIPT if filtered else "import tarfile\ndel tarfile.data_filter\n" + prefetch.SCRIPT
    res = subprocess.run([sys.executable, "-c", code, md5, str(data), prefetch.ARCHIVE, BATCHES, MARKER],
                         env={"DATA_URL": "-"}, capture_output=True, text=True, timeout=60)
    if filtered and case == "absolute":  # the data filter strips the leading / and extracts it inside
        assert res.returncode == 0 and (data / str(outside / "absolute").lstrip("/")).is_file()
    else:
        assert res.returncode == 5 and "error: extracting" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in outside.iterdir()) == ["victim"] and (outside / "victim").read_text() == "keep"
    assert not (tmp_path / "escaped").exists() and (data / MARKER).exists() == (res.returncode == 0)
    assert not (data / "null").exists() and not (data / "pipe").exists()


def test_the_fallback_extracts_a_plain_archive_and_clears_high_mode_bits(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = data / prefetch.ARCHIVE
    with tarfile.open(path, "w:gz") as tar:
        good = tarfile.TarInfo(f"{BATCHES}/data_batch_1")
        good.size, good.mode = 1, 0o4777
        tar.addfile(good, io.BytesIO(b"1"))
        tar.addfile(_member(f"{BATCHES}/alias", tarfile.SYMTYPE, "data_batch_1"))
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    code = "import tarfile\ndel tarfile.data_filter\n" + prefetch.SCRIPT
    res = subprocess.run([sys.executable, "-c", code, md5, str(data), prefetch.ARCHIVE, BATCHES, MARKER],
                         env={"DATA_URL": "-"}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (data / BATCHES / "alias").read_text() == "1" and (data / MARKER).exists()
    assert (data / BATCHES / "data_batch_1").stat().st_mode & 0o7777 == 0o755
