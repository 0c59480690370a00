"""`check`'s self-test: the containers it plans, its cells from the trainer's line, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate import cli
from orchestrate.checks import selfcheck
from orchestrate.checks.netcheck import Verdict
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import ConfigError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import build_plan
from orchestrate.remote.docker import JOB_LABEL
from trainer.contract import SELFTEST_MARK

SSH = SSHOptions(Path("hosts"), None, False)
HOSTS = [Host(name=f"n{i}", hostname=f"10.0.0.{i}", port=22, user="u", slots=None) for i in range(2)]
PASSED = {"device": "cuda:0", "precision": "fp16", "scaler": True, "steps": 3, "loss": 2.3456, "step_s": 0.0123,
          "ckpt_bytes": 45_000_000, "ckpt_ok": True, "error": None}


def test_check_takes_the_precision_and_model_of_the_trainers_step() -> None:
    _, config = cli.parse_args(["check", "--hosts", "h", "--gpus", "8", "--precision", "fp16"])
    assert isinstance(config, UpConfig) and config.trainer_args == ("--precision", "fp16", "--model", "resnet18")
    _, config = cli.parse_args(["check", "--hosts", "h", "--gpus", "0", "--model", "tiny"])
    assert isinstance(config, UpConfig) and config.trainer_args == ("--precision", "bf16", "--model", "tiny")
    with pytest.raises(ConfigError):
        cli.parse_args(["check", "--hosts", "h", "--precision", "fp8"])


def test_a_gpu_job_self_tests_on_cuda_with_its_gpus_and_a_cpu_job_on_the_cpu() -> None:
    gpu = UpConfig(ssh=SSH, gpus=8, job="r18", trainer_args=("--precision", "fp16"))
    specs = selfcheck.selftest_specs(build_plan(gpu, HOSTS, "10.0.0.0"), gpu)
    assert specs[1].command == ("python3", "-m", "trainer.selftest", "--precision", "fp16", "--device", "cuda")
    assert specs[1].name == "r18-selftest-node1" and specs[1].labels[JOB_LABEL] == "r18-selftest"
    assert specs[1].mounts == () and specs[1].network_mode == "none" and specs[1].gpus == 8
    cpu = UpConfig(ssh=SSH, gpus=0, trainer_args=("--precision", "bf16"))
    assert selfcheck.selftest_specs(build_plan(cpu, HOSTS, "10.0.0.0"), cpu)[0].command[-2:] == ("--device", "cpu")


def test_cells_from_the_trainers_line() -> None:
    payload = selfcheck.parse("noise\n" + SELFTEST_MARK + json.dumps(PASSED) + "\n")
    assert selfcheck.step_cell(payload, 0) == selfcheck.Cell(True, "fp16 on cuda:0, scaler: 3 steps, loss 2.346, 12 ms/step")
    assert selfcheck.ckpt_cell(payload) == selfcheck.Cell(True, "saved, loaded, equal (45.0 MB)")
    failed = {**PASSED, "steps": 0, "error": "DeviceError: --device cuda was requested but CUDA is not available"}
    assert selfcheck.step_cell(failed, 1) == selfcheck.Cell(False, failed["error"])
    assert selfcheck.ckpt_cell(failed).ok is False
    assert "no self-test answer (exit code 127)" in selfcheck.step_cell(None, 127).text


def test_network_cells_name_who_could_not_join_and_the_outlier() -> None:
    verdict = Verdict(0.1, {(0, 1): 0.1, (0, 2): 0.1, (1, 2): 0.01}, {0: 0.1, 1: 0.1, 2: 0.01}, [2], {})
    cells = selfcheck.network_cells(verdict, 3)
    assert [c.ok for c in cells] == [True, True, False] and cells[2].text == "best pair 10.0 MB/s OUTLIER"
    unreachable = Verdict(None, {}, {}, [], {1: "cannot reach the master"})
    assert selfcheck.network_cells(unreachable, 2)[1] == selfcheck.Cell(False, "cannot join: cannot reach the master")
