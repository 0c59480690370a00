"""python -m trainer.selftest: a few steps of the trainer's own model and a checkpoint round trip, one line out.
On CPU here; with --device cuda on a node without CUDA it must fail, not fall back to the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import selftest
from trainer.contract import SELFTEST_FIELDS, SELFTEST_MARK

REPO = Path(__file__).resolve().parents[2]


def test_steps_and_checkpoint_pass_in_bf16_on_cpu(tmp_path: Path) -> None:
    out = selftest.run(["--precision", "bf16", "--device", "cpu", "--model", "tiny"], tmp_path)
    assert set(out) == set(SELFTEST_FIELDS)
    assert out["error"] is None, out
    assert (out["device"], out["precision"], out["scaler"], out["steps"]) == ("cpu", "bf16", False, selftest.STEPS)
    assert out["ckpt_ok"] is True and out["ckpt_bytes"] > 1000
    assert out["loss"] > 0 and out["step_s"] > 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".pt"]  # a checkpoint and its manifest


def test_a_gpu_job_without_cuda_fails_instead_of_training_on_the_cpu(tmp_path: Path) -> None:
    out = selftest.run(["--precision", "bf16", "--device", "cuda", "--model", "tiny"], tmp_path)
    assert out["steps"] == 0 and out["device"] is None
    assert out["error"].startswith("DeviceError: --device cuda was requested but CUDA is not available")


@pytest.mark.parametrize("args", [["--precision", "bf16"], ["--model", "no-such-model"]])
def test_the_module_prints_one_marked_line_and_its_exit_code_says_whether_all_passed(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer.selftest", "--device", "cpu", "--model", "tiny", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(SELFTEST_MARK)]
    assert len(lines) == 1, done.stdout + done.stderr
    payload = json.loads(lines[0][len(SELFTEST_MARK):])
    assert done.returncode == (0 if payload["error"] is None else 1)
    assert (payload["error"] is None) == (args[0] == "--precision"), payload
