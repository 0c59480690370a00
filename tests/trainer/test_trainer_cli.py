"""The trainer's command line end to end on CPU: bad input gives one `error:` line and exit 2; bf16 runs;
the trainer really learns. Most cases call main() in-process (the real code path, without a 2 s torch
import per case); one case runs the real `python -m trainer` to check the process's exit code and stderr."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_helpers import REPO, base_args, child_env, metrics_lines, tmpfs

from trainer import data
from trainer.__main__ import main


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


@pytest.fixture
def ro_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system: unwritable even for root."""
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mnt:
        yield mnt


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "full", "size=8k") as mnt:
        yield mnt


@pytest.fixture
def corrupt_data(tmp_path: Path) -> Path:
    data.write_synthetic(tmp_path / "corrupt", 10, 2)
    (tmp_path / "corrupt" / data.BASE_FOLDER / "data_batch_1").write_bytes(b"\x80\x02garbage")
    return tmp_path / "corrupt"


# Bad input table (issue 5): case -> extra args / replaced args -> words the error line must contain.
CASES = {
    "batch size 0": (["--batch-size", "0"], "--batch-size must be a positive integer"),
    "epochs negative": (["--epochs", "-2"], "--epochs must be a positive integer"),
    "unknown model": (["--model", "resnet9000"], "unknown model 'resnet9000'"),
    "fp16 on CPU": (["--precision", "fp16"], "fp16 needs a CUDA device"),
    "sync-bn on CPU": (["--sync-bn"], "--sync-bn needs a CUDA device"),
    "apex on CPU": (["--optimizer", "apex-fused-sgd"], "apex-fused-sgd needs a CUDA device"),
    "bf16 compression on CPU": (["--grad-compression", "bf16"], "bf16 needs a CUDA device; gloo cannot"),
    "cuda missing": (["--device", "cuda"], "CUDA is not available"),
    "batch larger than data": (["--batch-size", "100000"], "exceeds the 512 training images"),
    "resume without checkpoint": (["--resume"], "no valid checkpoint"),
    "unknown option": (["--frobnicate"], "unrecognized arguments: --frobnicate"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_and_exit_2(case: str, data_dir: Path, tmp_path: Path, inprocess: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    extra, needle = CASES[case]
    assert main(base_args(data_dir, tmp_path / "ck", *extra)) == 2
    assert needle in _error_line(capsys)


@pytest.mark.parametrize(("case", "needle"), [
    ("data dir missing", "does not exist"),
    ("data corrupt", "data_batch_1 is corrupt"),
    ("wrong md5", "do not match the official CIFAR-10 md5"),
    ("ckpt dir unwritable", "is not writable"),
    ("ckpt dir on a full disk", "is full (no space left"),
    ("ckpt dir under a file", "is not writable"),
])
def test_bad_files_are_one_error_line_and_exit_2(case: str, needle: str, data_dir: Path, tmp_path: Path,
                                                 request: pytest.FixtureRequest, inprocess: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    d, ck = data_dir, tmp_path / "ck"
    if case == "data dir missing":
        d = tmp_path / "nothing-here"
    elif case == "data corrupt":
        d = request.getfixturevalue("corrupt_data")
    elif case == "ckpt dir unwritable":
        ck = request.getfixturevalue("ro_dir") / "ck"
    elif case == "ckpt dir on a full disk":
        ck = request.getfixturevalue("full_dir")
    elif case == "ckpt dir under a file":
        (tmp_path / "f").write_text("x")
        ck = tmp_path / "f" / "ck"
    args = base_args(d, ck, "--epochs", "1", "--batch-size", "64")
    if case == "wrong md5":
        args.remove("--allow-unverified-data")
    assert main(args) == 2
    assert needle in _error_line(capsys)


def test_real_process_exit_code_and_single_error_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer", "--data-dir", str(tmp_path / "none"), "--ckpt-dir",
                           str(tmp_path / "ck"), "--device", "cpu"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: data dir") and sum(line.startswith("error:") for line in lines) == 1


def test_bf16_autocast_trains_on_cpu(data_dir: Path, tmp_path: Path, inprocess: None,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    assert main(base_args(data_dir, ck, "--precision", "bf16", "--epochs", "1", "--batch-size", "64")) == 0
    rec = metrics_lines(ck)[-1]
    assert rec["epoch"] == 1 and rec["train_loss"] == rec["train_loss"] and 0 <= rec["test_acc"] <= 1
    assert "DONE epochs=1 step=8 test_acc=" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_trainer_really_learns(data_dir: Path, tmp_path: Path, inprocess: None) -> None:
    """Synthetic labels are a simple function of the pixels: a short run must reach high accuracy."""
    ck = tmp_path / "ck"
    assert main(base_args(data_dir, ck, "--epochs", "3", "--batch-size", "32", "--lr", "0.05")) == 0
    recs = metrics_lines(ck)
    assert [r["epoch"] for r in recs] == [1, 2, 3]
    assert recs[-1]["test_acc"] >= 0.9, recs
    assert recs[-1]["train_loss"] < recs[0]["train_loss"]
    assert recs[-1]["global_batch"] == 32 and recs[-1]["world_size"] == 1
