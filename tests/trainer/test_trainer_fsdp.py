"""--strategy fsdp with real torchrun processes (gloo, CPU): training, sharded checkpoints, resharded resume."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kit.net import free_port
from kit.trainer_helpers import (
    REPO,
    base_args,
    child_env,
    metrics_lines,
    run_torchrun,
    torchrun_cmd,
)
from kit.waits import wait_until
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainer import dcp_checkpoint
from trainer.__main__ import main
from trainer.contract import SHARDED_TMP_RE, ckpt_folder_name

FSDP = ("--strategy", "fsdp")


def _full_model(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict of a sharded checkpoint, read without any process group."""
    out = tmp / f"{folder.name}-{len(list(tmp.iterdir()))}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)["model"]


def _tmp_step(folder: Path) -> int:
    match = SHARDED_TMP_RE.fullmatch(folder.name)
    return int(match.group(1)) if match else -1


def _kill_job(job: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun and its ranks at once (torchrun starts each rank in a session of its own, so a
    process-group kill would leave them running), then wait until they are gone."""
    kids = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
    for pid in (job.pid, *map(int, kids)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in kids), 30, "the killed ranks to be gone",
               every=0.05)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol), f"{key} differs by {(a[key] - b[key]).abs().max()}"


@pytest.mark.slow
def test_fsdp_trains_and_learns_on_2_processes(data_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = run_torchrun(2, base_args(data_dir, ckpt, *FSDP, "--epochs", "2", "--batch-size", "32"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = metrics_lines(ckpt)
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"] and epochs[1]["test_acc"] > 0.3  # chance is 0.1
    info = dcp_checkpoint.newest_valid(ckpt)
    assert info is not None and info.path.name == ckpt_folder_name(16) and info.manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.pt"} <= set(info.manifest.files)
    assert "fsdp: params" in proc.stderr  # the memory line per process


@pytest.mark.slow
def test_saved_at_4_processes_resumes_at_3_and_at_1_resharded(data_dir: Path, tmp_path: Path, inprocess: None) -> None:
    """Global batch 48 (12 x 4); checkpoint at step 3; resumed to step 6 at 3 processes (16 each) and at 1
    (48 in micro-batches of 12) with --keep-global-batch: the same batches in the same order, so the weights
    at step 6 match an uninterrupted run's on that global batch, up to the order of float sums. The uninterrupted
    run is one process of 48 in this test's own process (tiny's GroupNorm makes a batch's gradient the mean of
    per-image ones however the 48 are split; rank r of 4 takes every 4th image of the same shuffled order, so
    each step's 48 images are the same): a 4-process one cost 5 more torch processes and checked nothing more
    than the 3- and 1-process resumes do against it. The sums' order differs from the resumes' in every step, not
    only after step 3: up to 2.2e-5 apart at step 6 (1e-5 against a 4-process run), where one step moves a weight
    by up to 1.3e-2, so atol 1e-4 still fails a batch, learning rate or momentum that is not the run's."""
    args = (*FSDP, "--batch-size", "12", "--epochs", "2")
    straight, at3, at1 = tmp_path / "straight", tmp_path / "at3", tmp_path / "at1"
    assert main(base_args(data_dir, straight, *FSDP, "--batch-size", "48", "--epochs", "2", "--max-steps", "6")) == 0
    proc = run_torchrun(4, base_args(data_dir, at3, *args, "--max-steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(at3, at1)
    saved = _full_model(at3 / ckpt_folder_name(3), tmp_path)
    for nproc, ckpt in ((3, at3), (1, at1)):
        resumed = ("--resume", "--keep-global-batch")
        # The state the trainer's own restore puts in place, gathered back: equal to the state saved.
        out = tmp_path / f"loaded-{nproc}.pt"
        worker = (str(REPO / "tests" / "trainer" / "fsdp_load_worker.py"), str(out))
        load = subprocess.run(torchrun_cmd(nproc, base_args(data_dir, ckpt, *args, *resumed), entry=worker),
                              cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
        assert load.returncode == 0, load.stderr[-3000:]
        loaded = torch.load(out, weights_only=True)
        assert (loaded["step"], loaded["sample"], loaded["epoch"]) == (3, 3 * 48, 0)
        _assert_close(loaded["model"], saved, atol=0.0)
        proc = run_torchrun(nproc, base_args(data_dir, ckpt, *args, *resumed, "--max-steps", "6"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "step 4 loss" in proc.stderr and "step 3 loss" not in proc.stderr
        last = metrics_lines(ckpt)[-1]
        assert last["step"] == 6 and last["global_batch"] == 48 and math.isfinite(last["train_loss"])
        _assert_close(_full_model(ckpt / ckpt_folder_name(6), tmp_path),
                      _full_model(straight / ckpt_folder_name(6), tmp_path), atol=1e-4)


@pytest.mark.slow
def test_sigkill_during_a_sharded_save_never_leaves_a_checkpoint_that_counts_but_cannot_load(
        data_dir: Path, tmp_path: Path) -> None:
    """The whole job is SIGKILLed while a later checkpoint's temporary folder exists (its save under way): no folder named ckpt-<step> is incomplete, the newest valid one loads, and a resume finishes."""
    ckpt = tmp_path / "ckpt"
    args = base_args(data_dir, ckpt, *FSDP, "--epochs", "30", "--batch-size", "32")
    job = subprocess.Popen(torchrun_cmd(2, args), cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            saving = [p for p in ckpt.glob(".ckpt-*.tmp") if _tmp_step(p) > 8]
            if saving:
                break
            time.sleep(0.005)
        assert saving, "the job never started its second save"
    finally:
        _kill_job(job)
    for folder in ckpt.glob("ckpt-*"):
        info = dcp_checkpoint._validate(folder)
        assert info is not None, f"{folder} has a checkpoint's name but is not a complete one"
        _full_model(folder, tmp_path)  # loads
    newest = dcp_checkpoint.newest_valid(ckpt)  # the save before, at least (the killed one may have made it)
    assert newest is not None
    stop_at = newest.manifest.step + 8
    proc = run_torchrun(2, [*args, "--resume", "--max-steps", str(stop_at)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert math.isfinite(metrics_lines(ckpt)[-1]["train_loss"]) and metrics_lines(ckpt)[-1]["step"] == stop_at
    assert not list(ckpt.glob(".ckpt-*.tmp"))  # the killed save's folder was cleared by a later save


def test_an_option_fsdp_cannot_honour_is_one_error_line(data_dir: Path, tmp_path: Path, inprocess: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(base_args(data_dir, tmp_path / "c", *FSDP, "--grad-compression", "fp16"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --strategy fsdp cannot honour --grad-compression: FSDP2 has no DDP")
    assert not (tmp_path / "c").exists()  # nothing started


@pytest.mark.slow
def test_two_nodes_with_their_own_ckpt_dirs_leave_one_complete_checkpoint_on_node_0(data_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """Two torchrun agents (--nnodes 2) on this machine, each node with its own --ckpt-dir as on a cluster:
    node 1's shard reaches node 0 over the process group, node 0's folder loads alone (at 1 process, resharded)
    and node 1 keeps no partial copy. Asynchronous checkpoints: step 2's (an epoch's end) is gathered and sealed
    in the background, on the checkpoint group; step 3's, the end's, synchronously."""
    args = (*FSDP, "--batch-size", "128", "--epochs", "2", "--max-steps", "3", "--ckpt-async", "on")
    node0, node1, port = tmp_path / "node0", tmp_path / "node1", str(free_port())
    agents = []
    for node, ckpt in enumerate((node0, node1)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, "-m", "trainer",
               *base_args(data_dir, ckpt, *args)]
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True))
    errs = [a.communicate(timeout=240)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    for step in (2, 3):  # the background save, then the end's
        info = dcp_checkpoint._validate(node0 / ckpt_folder_name(step))
        assert info is not None and info.manifest.step == step and info.manifest.world_size == 2
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(info.manifest.files)
        _full_model(info.path, tmp_path)  # every chunk of every tensor is in node 0's folder
    assert "sharded checkpoint of step 2 copied off the device" in errs[0]
    assert not list(node1.rglob("*.distcp"))  # sent, then removed there
    proc = run_torchrun(1, base_args(data_dir, node0, *FSDP, "--batch-size", "128", "--epochs", "2",
                                     "--max-steps", "5", "--resume", "--keep-global-batch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4 loss" in proc.stderr and metrics_lines(node0)[-1]["global_batch"] == 256
