"""The trainer's command line end to end on CPU: bad input gives one `error:` line and exit 2; bf16 runs;
the trainer really learns. Most cases call main() in-process (the real code path, without a 2 s torch
import per case); one case runs the real `python -m trainer` to check the process's exit code and stderr."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kit.disks import tmpfs
from kit.trainer_helpers import REPO, base_args, child_env, metrics_lines

from trainer import checkpoint, contract, data
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
    "unknown model": (["--model", "resnet9000"], "--model 'resnet9000' is not a model"),
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
                                                no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
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


def _damaged_batch(data_dir: Path, tmp_path: Path, case: str) -> Path:
    """A copy of the data set whose data_batch_1 is damaged as `case` says."""
    out = tmp_path / "damaged"
    shutil.copytree(data_dir, out)
    path = out / data.BASE_FOLDER / "data_batch_1"
    batch = pickle.loads(path.read_bytes())
    if case == "unknown codec":  # _codecs.encode('x', 'nosuchcodec'): a LookupError while unpickling
        path.write_bytes(b"\x80\x02c_codecs\nencode\nq\x00X\x01\x00\x00\x00xX\x0b\x00\x00\x00nosuchcodec\x86R.")
        return out
    n = len(batch["labels"])
    labels = {"no labels": None, "string labels": ["cat"] * n, "label 2**70": [2**70] + batch["labels"][1:],
              "numeric strings": ["3"] * n, "float labels": [2.7] * n, "bool labels": [True] * n}[case]
    batch["labels"] = labels
    path.write_bytes(pickle.dumps(batch, protocol=2))
    return out


@pytest.mark.parametrize(("case", "needle"), [
    ("no labels", "'labels' must be"), ("string labels", "'labels' must be"), ("label 2**70", "'labels' must be"),
    ("numeric strings", "'labels' must be"), ("float labels", "'labels' must be"), ("bool labels", "'labels' must be"),
    ("unknown codec", "data_batch_1 is corrupt (unknown encoding: nosuchcodec)"),
])
def test_a_damaged_batch_is_one_error_line(case: str, needle: str, data_dir: Path, tmp_path: Path,
                                           inprocess: None, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = _damaged_batch(data_dir, tmp_path, case)
    assert main(base_args(damaged, tmp_path / "ck", "--epochs", "1", "--batch-size", "64")) == 2
    assert needle in _error_line(capsys)


@pytest.mark.parametrize("closed", [data.BASE_FOLDER, "."])
def test_a_data_folder_that_cannot_be_entered_is_one_error_line(
        closed: str, shared_tmp: Path, run_as_nobody: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """The real `python -m trainer` as the unprivileged account `nobody` (root enters any folder, whatever its
    mode), on a data folder of mode 000, or a --data-dir of mode 000 (its cifar-10-batches-py cannot be reached)."""
    data.write_synthetic(shared_tmp / "data", 10, 2)
    (shared_tmp / "data" / closed).chmod(0)
    proc = run_as_nobody(["-m", "trainer", *base_args(shared_tmp / "data", shared_tmp / "ck")], shared_tmp)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"error: cannot read data folder {shared_tmp / 'data' / data.BASE_FOLDER} (Permission "
                        "denied); check the permissions of it and of --data-dir")


def test_an_unreadable_data_file_is_one_error_line(data_dir: Path, tmp_path: Path, inprocess: None,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = Path.open

    def denied(self: Path, *a: Any, **k: Any) -> Any:  # root reads any mode bits: deny like a foreign file
        if self.name == "test_batch":
            raise PermissionError(13, "Permission denied")
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", denied)
    assert main(base_args(data_dir, tmp_path / "ck", "--epochs", "1", "--batch-size", "64")) == 2
    line = _error_line(capsys)
    assert "cannot read" in line and "test_batch (Permission denied)" in line


class _Payload:
    """What a hostile checkpoint holds: unpickling it calls a function (a harmless one here)."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return os.getcwd, ()


@pytest.mark.parametrize(("case", "needle"), [
    ("a list", "is not one this trainer wrote (it holds a list"),
    ("no epoch", "is not one this trainer wrote ('epoch' is missing"),
    ("weights of another shape", "does not fit this run's model or optimizer"),
    ("empty optimizer state", "does not fit this run's model or optimizer"),
    ("a __reduce__ payload", "holds objects that are not tensors or plain values (Trying to load unsupported "
                             "GLOBAL posix.getcwd whose module posix is blocked.); it was not written by this trainer"),
])
def test_a_checkpoint_not_written_by_the_trainer_is_refused_on_resume(
        case: str, needle: str, data_dir: Path, tmp_path: Path, inprocess: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    assert main(base_args(data_dir, ck, "--epochs", "1", "--batch-size", "64")) == 0
    info = checkpoint.newest_valid(ck)
    assert info is not None
    state = torch.load(info.path, weights_only=True)
    if case == "a list":
        state = [1, 2, 3]
    elif case == "no epoch":
        del state["epoch"]
    elif case == "a __reduce__ payload":
        state["model"] = _Payload()
    elif case == "weights of another shape":
        state["model"]["fc.weight"] = torch.zeros(3, 3)
    else:
        state["optimizer"] = {}
    buf = io.BytesIO()
    torch.save(state, buf)
    info.path.write_bytes(buf.getvalue())  # with a manifest that matches it: only its content is wrong
    manifest = ck / contract.manifest_name(info.step)
    fields = json.loads(manifest.read_text()) | {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
                                                 "bytes": len(buf.getvalue())}
    manifest.write_text(json.dumps(fields))
    capsys.readouterr()
    assert main(base_args(data_dir, ck, "--epochs", "2", "--batch-size", "64", "--resume")) == 2
    line = _error_line(capsys)
    assert needle in line and str(info.path) in line


def test_synth_refuses_an_absurd_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert data.main(["synth", "--out", str(tmp_path), "--train", str(10**13)]) == 2
    assert "--train between 5 and 500000" in capsys.readouterr().err


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
