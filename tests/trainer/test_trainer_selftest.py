"""python -m trainer.selftest: a few steps of the trainer's own model with the job's strategy and precision and a
checkpoint round trip in the job's format, one line out per process. On CPU here, one process and under torchrun;
with --device cuda on a node without CUDA (hidden on a GPU machine) it must fail, not fall back to the CPU. The GPU
tier (tests/trainer/gpu) runs it on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kit.trainer_helpers import child_env, torchrun_cmd

from trainer import selftest
from trainer.contract import SELFTEST_FIELDS, SELFTEST_MARK

REPO = Path(__file__).resolve().parents[2]


def test_steps_and_checkpoint_pass_in_bf16_on_cpu(tmp_path: Path) -> None:
    out = selftest.run(["--precision", "bf16", "--device", "cpu", "--model", "tiny"], tmp_path)
    assert set(out) == set(SELFTEST_FIELDS)
    assert out["error"] is None, out
    assert (out["device"], out["precision"], out["scaler"], out["steps"]) == ("cpu", "bf16", False, selftest.STEPS)
    assert (out["rank"], out["world_size"], out["strategy"]) == (0, 1, "ddp")
    assert out["ckpt_ok"] is True and out["ckpt_bytes"] > 1000
    assert out["loss"] > 0 and out["step_s"] > 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".pt"]  # a checkpoint and its manifest


def test_the_trainers_default_precision_auto_is_resolved_as_the_job_resolves_it(tmp_path: Path) -> None:
    """No --precision: the trainer's `auto`, fp32 on a CPU (it reached autocast as "auto" and failed before)."""
    out = selftest.run(["--device", "cpu", "--model", "tiny"], tmp_path)
    assert out["error"] is None and out["precision"] == "fp32" and out["steps"] == selftest.STEPS, out


def test_a_gpu_job_without_cuda_fails_instead_of_training_on_the_cpu(tmp_path: Path, no_cuda: None) -> None:
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


def test_under_torchrun_fsdp_shards_steps_and_restores_its_sharded_folder_on_every_process() -> None:
    """What `check` runs for an FSDP job: its processes, FSDP2 built (the model is sharded only with peers),
    the DCP folder written by every rank and restored into zeroed weights."""
    done = subprocess.run(torchrun_cmd(2, ["--strategy", "fsdp", "--precision", "bf16", "--device", "cpu", "--model",
                                           "tiny"], entry=("-m", "trainer.selftest")),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180, check=False)
    answers = sorted((json.loads(ln[len(SELFTEST_MARK):]) for ln in done.stdout.splitlines()
                      if ln.startswith(SELFTEST_MARK)), key=lambda a: a["rank"])
    assert done.returncode == 0 and [a["rank"] for a in answers] == [0, 1], done.stdout + done.stderr[-2000:]
    for a in answers:
        assert (a["world_size"], a["strategy"], a["precision"], a["steps"], a["ckpt_ok"], a["error"]) == \
            (2, "fsdp", "bf16", selftest.STEPS, True, None)
    assert answers[0]["ckpt_bytes"] > 1000 and answers[1]["ckpt_bytes"] == 0  # rank 0 holds the sealed folder
