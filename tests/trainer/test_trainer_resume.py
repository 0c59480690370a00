"""Exact resume: an interrupted and resumed run ends with bitwise the same weights as an uninterrupted one
(CPU, deterministic kernels, one thread), at an epoch boundary and in the middle of an epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kit.trainer_helpers import base_args, metrics_lines, newest_state

from trainer.__main__ import main

COMMON = ("--epochs", "2", "--batch-size", "32", "--warmup-epochs", "0.5", "--model", "resnet20")


@pytest.fixture(scope="module")
def straight(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    ck = tmp_path_factory.mktemp("straight")
    torch.use_deterministic_algorithms(True)
    try:
        assert main(base_args(data_dir, ck, *COMMON)) == 0
    finally:
        torch.use_deterministic_algorithms(False)
    return newest_state(ck)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [16, 21])  # 16 steps per epoch: a boundary, then mid-epoch
def test_stop_and_resume_gives_bitwise_identical_weights(stop_at: int, straight: dict, data_dir: Path,
                                                         tmp_path: Path, inprocess: None) -> None:
    ck = tmp_path / "ck"
    torch.use_deterministic_algorithms(True)
    try:
        assert main(base_args(data_dir, ck, *COMMON, "--max-steps", str(stop_at))) == 0
        first = newest_state(ck)
        assert first["step"] == stop_at and first["samples_in_epoch"] == (stop_at % 16) * 32
        assert main(base_args(data_dir, ck, *COMMON, "--resume")) == 0
    finally:
        torch.use_deterministic_algorithms(False)
    resumed = newest_state(ck)
    assert resumed["step"] == straight["step"] == 32 and resumed["epoch"] == 2
    for name, tensor in straight["model"].items():  # BatchNorm running stats included
        assert torch.equal(tensor, resumed["model"][name]), name
    assert torch.equal(straight["optimizer"]["state"][0]["momentum_buffer"],
                       resumed["optimizer"]["state"][0]["momentum_buffer"])
    assert metrics_lines(ck)[-1]["epoch"] == 2


def test_resume_refuses_a_checkpoint_of_another_model(data_dir: Path, tmp_path: Path, inprocess: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    assert main(base_args(data_dir, ck, "--epochs", "1", "--batch-size", "64", "--max-steps", "1")) == 0
    capsys.readouterr()
    assert main(base_args(data_dir, ck, "--epochs", "1", "--batch-size", "64", "--resume",
                          "--model", "resnet20")) == 2
    assert "was trained with --model tiny" in capsys.readouterr().err


def test_resume_skips_a_cut_short_checkpoint_with_a_warning(data_dir: Path, tmp_path: Path, inprocess: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    args = base_args(data_dir, ck, "--epochs", "3", "--batch-size", "64")  # 8 steps per epoch
    assert main([*args, "--max-steps", "16"]) == 0
    newest = ck / "ckpt-00000016.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # cut short, as by a crash of the disk under it
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipping invalid checkpoint" in err and "ckpt-00000016.json" in err
    assert "resuming from" in err and "ckpt-00000008.pt" in err
    assert newest_state(ck)["step"] == 24


def test_a_run_that_ends_inside_an_epoch_leaves_a_partial_metrics_record(data_dir: Path, tmp_path: Path,
                                                                        inprocess: None) -> None:
    ck = tmp_path / "ck"
    assert main(base_args(data_dir, ck, "--epochs", "2", "--batch-size", "64", "--max-steps", "3")) == 0  # 8/epoch
    records = metrics_lines(ck)
    assert len(records) == 1 and records[0]["partial"] is True
    assert records[0]["step"] == 3 and records[0]["epoch"] == 0 and records[0]["test_acc"] is not None
