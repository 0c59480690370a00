"""`check`'s self-test: the containers it plans, its cells from the trainer's line, and the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kit.units import SSH, job_specs

from orchestrate import cli
from orchestrate.checks import selfcheck
from orchestrate.checks.netcheck import Verdict
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError
from orchestrate.hosts import Host
from orchestrate.labels import JOB_LABEL
from orchestrate.plan import shortlived
from orchestrate.probe.observations import Launcher
from trainer.contract import SELFTEST_MARK

HOSTS = [Host(name=f"n{i}", hostname=f"10.0.0.{i}", port=22, user="u", slots=None) for i in range(2)]
PASSED = {"rank": 0, "world_size": 8, "device": "cuda:0", "strategy": "fsdp", "precision": "fp16", "scaler": True,
          "steps": 3, "loss": 2.3456, "step_s": 0.0123, "ckpt_bytes": 45_000_000, "ckpt_ok": True, "error": None}


def test_check_passes_the_jobs_trainer_options_and_only_the_ones_given() -> None:
    _, config = cli.parse_args(["check", "--hosts", "h", "--gpus", "8", "--precision", "fp16", "--strategy", "fsdp"])
    assert isinstance(config, UpConfig) and config.program.trainer_args == ("--strategy", "fsdp", "--precision", "fp16")
    # Nothing given: the trainer's own defaults, as the job gets them.
    _, config = cli.parse_args(["check", "--hosts", "h", "--gpus", "0", "--model", "tiny"])
    assert isinstance(config, UpConfig) and config.program.trainer_args == ("--model", "tiny")
    # The same options after -- as up takes; they come last, so they win.
    _, config = cli.parse_args(["check", "--hosts", "h", "--precision", "fp16", "--", "--strategy", "fsdp",
                                "--batch-size", "256", "--precision", "bf16"])
    assert isinstance(config, UpConfig) and config.program.trainer_args[-2:] == ("--precision", "bf16")
    for bad in (["--precision", "fp8"], ["--", "--strategy", "zero3"], ["--", "--data-dir", "/x"]):
        with pytest.raises((ConfigError, SystemExit)):
            cli.parse_args(["check", "--hosts", "h", *bad])
    _, config = cli.parse_args(["check", "--hosts", "h", "--min-busbw", "40", "--min-node-busbw", "200"])
    assert isinstance(config, UpConfig) and (config.checks.check_min_busbw, config.checks.check_min_node_busbw) == (40.0, 200.0)
    with pytest.raises(ConfigError, match="--min-busbw -1.0 must be a bandwidth"):
        cli.parse_args(["check", "--hosts", "h", "--min-busbw", "-1"])


def test_the_self_test_runs_the_jobs_processes_under_its_launcher_on_cuda_or_the_cpu() -> None:
    gpu = UpConfig.of(ssh=SSH, gpus=8, job="r18", trainer_args=("--strategy", "fsdp", "--precision", "fp16"))
    specs = shortlived.selftest(job_specs(gpu, HOSTS, "10.0.0.0"), gpu.program, gpu.resources,
                                ("python3", "-m", "torch.distributed.run"))
    assert specs[1].command == ("python3", "-m", "torch.distributed.run", "--nnodes", "1", "--master_addr", "127.0.0.1",
                                "--master_port", "29500", "--nproc_per_node", "8", "-m", "trainer.selftest",
                                "--strategy", "fsdp", "--precision", "fp16", "--device", "cuda")
    # No network in the container: the rendezvous and the process group on loopback.
    assert specs[1].env["MASTER_ADDR"] == "127.0.0.1" and specs[1].env["GLOO_SOCKET_IFNAME"] == "lo"
    assert specs[1].env["LOG_DIR"] == "/tmp"  # no mounts: rank 0's NCCL log goes where it can be written
    assert specs[1].name == "r18-selftest-node1" and specs[1].labels[JOB_LABEL] == "r18-selftest"
    assert specs[1].mounts == () and specs[1].network_mode == "none" and specs[1].gpus == 8
    cpu = UpConfig.of(ssh=SSH, gpus=0, trainer_args=("--precision", "bf16"))
    # A job of one process a node runs trainer.launch; the self-test's two processes run under torchrun.
    light = Launcher(("torchrun",), ("python3", "-m", "trainer.launch"))
    command = shortlived.selftest(job_specs(cpu, HOSTS, "10.0.0.0", launcher=light), cpu.program, cpu.resources,
                                  ("torchrun",))[0].command
    assert command[:2] == ("torchrun", "--nnodes")
    assert command[7:9] == ("--nproc_per_node", "2") and command[-2:] == ("--device", "cpu")
    slots = [dataclasses.replace(h, slots=4) for h in HOSTS]
    assert shortlived.selftest(job_specs(cpu, slots, "10.0.0.0"), cpu.program, cpu.resources, ("torchrun",))[0].command[8] == "4"


def test_cells_from_the_processes_lines() -> None:
    second = {**PASSED, "rank": 1, "ckpt_bytes": 0}
    payload = selfcheck.parse("noise\n" + "".join(SELFTEST_MARK + json.dumps(p) + "\n" for p in (second, PASSED)))
    assert selfcheck.step_cell(payload, 0) == selfcheck.Cell(
        True, "fsdp fp16 on 8 x cuda, scaler: 3 steps, loss 2.346, 12 ms/step")
    assert selfcheck.ckpt_cell(payload) == selfcheck.Cell(True, "sharded folder saved, restored, equal (45.0 MB)")
    assert selfcheck.ckpt_cell({**PASSED, "strategy": "ddp"}).text == "saved, loaded, equal (45.0 MB)"
    # A process that failed is the node's answer, whatever rank 0 said.
    failed = {**PASSED, "rank": 3, "steps": 0, "error": "RuntimeError: expected scalar type BFloat16 but found Float"}
    payload = selfcheck.parse("".join(SELFTEST_MARK + json.dumps(p) + "\n" for p in (PASSED, failed)))
    assert selfcheck.step_cell(payload, 1) == selfcheck.Cell(False, f"rank 3: {failed['error']}")
    assert selfcheck.ckpt_cell(payload).ok is False
    assert "no self-test answer (exit code 127)" in selfcheck.step_cell(None, 127).text
    # Two processes' lines run together in the container's stream (seen with torchrun's unbuffered workers).
    joined = SELFTEST_MARK + json.dumps(second) + SELFTEST_MARK + json.dumps(failed) + "\n\n"
    assert selfcheck.parse(joined) == failed and selfcheck.parse(SELFTEST_MARK + "{broken\n") is None
    # Every line passed, but a process ended badly (killed by torchrun after a peer died without a word).
    assert selfcheck.step_cell(PASSED, 1).ok is False


def test_network_cells_name_who_could_not_join_the_outlier_and_what_failed() -> None:
    verdict = Verdict(0.1, {(0, 1): 0.1, (0, 2): 0.1, (1, 2): 0.01}, {0: 0.1, 1: 0.1, 2: 0.01}, [2], {},
                      within_gbps={0: 300.0, 1: 300.0, 2: 1.0}, problems={2: ["within the node 1.0 GB/s, below the floor 2.0 GB/s"]})
    cells = selfcheck.network_cells(verdict, 3)
    assert [c.ok for c in cells] == [True, True, False]
    assert cells[0].text == "within 300.0 GB/s, best pair 100.0 MB/s"
    assert cells[2].text == "within 1.0 GB/s, best pair 10.0 MB/s, OUTLIER, within the node 1.0 GB/s, below the floor 2.0 GB/s"
    unreachable = Verdict(None, {}, {}, [], {1: "cannot reach the master"})
    assert selfcheck.network_cells(unreachable, 2)[1] == selfcheck.Cell(False, "cannot join: cannot reach the master")
