"""What the orchestrator's restarts and progress display rely on: the heartbeat, resume records that keep
metrics.jsonl continuous, time-based checkpoints, the global batch kept on fewer processes, stack dumps on
SIGUSR1, the test-only crash."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kit.trainer_helpers import REPO, base_args, child_env, metrics_lines, newest_state

from trainer import checkpoint, contract, loop, metrics
from trainer.__main__ import main

# The bug the cluster tests plant in the trainer (not a package: it is copied into their image's site-packages).
CRASH_PROGRAM = REPO / "tests" / "programs" / "crash_at_step" / "crash_at_step.py"
_spec = importlib.util.spec_from_file_location("crash_at_step", CRASH_PROGRAM)
assert _spec and _spec.loader
crash_at_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_at_step)


def test_heartbeat_advances_to_the_totals_and_its_eta_falls(data_dir: Path, tmp_path: Path, inprocess: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every beat is kept (the file is rewritten): values advance, the last one is the run's end."""
    ck, beats = tmp_path / "ck", []
    real_write = metrics.write_json_atomic

    def keep(path: Path, data: dict, durable: bool = True) -> None:
        beats.append(data)
        real_write(path, data, durable)

    monkeypatch.setattr(metrics, "HEARTBEAT_S", 0.0)  # a beat every step
    monkeypatch.setattr(metrics, "write_json_atomic", keep)
    assert main(base_args(data_dir, ck, "--epochs", "2", "--batch-size", "64")) == 0  # 8 steps per epoch
    training = [b for b in beats if b["state"] == "training" and "eta_s" in b]
    steps = [b["step"] for b in training]
    assert steps == sorted(steps) and steps[-1] == 16 and len(set(steps)) >= 10
    assert all(b["total_steps"] == 16 and b["epochs"] == 2 for b in beats)
    assert training[-1]["eta_s"] < training[0]["eta_s"]
    assert training[-1]["images_per_s"] > 0 and training[-1]["epoch"] == 2
    assert {b["state"] for b in beats} >= {"training", "evaluating", "checkpointing", "done"}
    final = json.loads((ck / metrics.HEARTBEAT_FILE).read_text())
    assert final["state"] == "done" and final["step"] == final["total_steps"] == 16 and final["eta_s"] == 0
    assert final["ckpt_step"] == 16 and final["slowest_step_s"] > 0


def test_a_phase_beat_shows_the_current_epoch_though_no_step_beat_was_written(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast steps write no beat of their own (one per HEARTBEAT_S): the evaluation and checkpoint beats between
    them still say where the run is (`up`'s progress line showed epoch 1 at step 40)."""
    ck, beats = tmp_path / "ck", []
    real_write = metrics.write_json_atomic

    def keep(path: Path, data: dict, durable: bool = True) -> None:
        beats.append(data)
        real_write(path, data, durable)

    monkeypatch.setattr(metrics, "HEARTBEAT_S", 1e9)  # no step writes a beat: only the phase marks do
    monkeypatch.setattr(metrics, "write_json_atomic", keep)
    assert main(base_args(data_dir, ck, "--epochs", "3", "--batch-size", "64")) == 0  # 8 steps per epoch
    phases = [(b["state"], b["step"], b["epoch"]) for b in beats if b["step"] > 0]
    assert {state for state, _, _ in phases} >= {"evaluating", "checkpointing", "training", "done"}
    assert all(epoch == -(-step // 8) for _, step, epoch in phases), phases


def test_resume_drops_records_after_the_checkpoint_and_records_the_restart(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = tmp_path / "ck"
    args = base_args(data_dir, ck, "--epochs", "3", "--batch-size", "64", "--keep-checkpoints", "5")
    assert main([*args, "--max-steps", "16"]) == 0  # epochs 1, 2 and their checkpoints at steps 8, 16
    # As if the run had gone on past its newest checkpoint before it died: a record the resume trains again.
    (ck / checkpoint.manifest_name(16)).unlink()
    monkeypatch.setenv(contract.ENV_RESTART, "1")
    monkeypatch.setenv(contract.ENV_RESTART_CAUSE, "node 1 (b) exited with code 1")
    assert main([*args, "--resume"]) == 0
    records = metrics_lines(ck)
    assert [(r.get("event"), r["step"]) for r in records] == [(None, 8), ("restart", 8), (None, 16), (None, 24)]
    restart = records[1]
    assert restart["restart"] == 1 and restart["cause"] == "node 1 (b) exited with code 1"
    assert restart["world_size"] == 1 and restart["epoch"] == 1


def test_a_restart_from_the_beginning_drops_every_record_and_records_the_restart(
        data_dir: Path, tmp_path: Path, inprocess: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure before the first checkpoint: the orchestrator starts the job over without --resume."""
    ck = tmp_path / "ck"
    args = base_args(data_dir, ck, "--epochs", "2", "--batch-size", "64", "--ckpt-every", "2")
    with monkeypatch.context() as crashing:
        crashing.setattr(metrics.Heartbeat, "step_done", metrics.Heartbeat.step_done)  # undone when the block ends
        crash_at_step.plant(metrics, 12)
        with pytest.raises(RuntimeError, match="injected crash at step 12"):
            main(args)
    assert [r["step"] for r in metrics_lines(ck)] == [8] and not list(ck.glob("ckpt-*.json"))
    monkeypatch.setenv(contract.ENV_RESTART, "1")
    monkeypatch.setenv(contract.ENV_RESTART_CAUSE, "node 1 (b) no training progress for 16 s after step 0")
    assert main(args) == 0
    records = metrics_lines(ck)
    assert [(r.get("event"), r["step"]) for r in records] == [("restart", 0), (None, 8), (None, 16)]
    assert records[0]["restart"] == 1 and records[0]["cause"].startswith("node 1 (b) no training progress")


def test_ckpt_every_minutes_saves_mid_epoch(data_dir: Path, tmp_path: Path, inprocess: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ck = tmp_path / "ck"
    clock = [0.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])

    real_step = loop.train_step

    def step_one_minute(*a: object, **k: object) -> torch.Tensor:
        clock[0] += 60.0  # each step "takes" a minute
        return real_step(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "train_step", step_one_minute)
    args = base_args(data_dir, ck, "--epochs", "1", "--batch-size", "16", "--keep-checkpoints", "20",
                     "--ckpt-every-minutes", "2.5")
    assert main(args) == 0
    steps = sorted(int(p.name[5:13]) for p in ck.glob("ckpt-*.json"))
    # Due after 3 steps each time; the ranks agree on it at steps 1, 2 and 3 (no step measured yet: Cadence),
    # then every AGREE_EVERY (8) steps (the real steps are fast): four mid-epoch saves, then the end of the
    # run (step 32).
    assert steps == [3, 8, 16, 24, 32]
    assert newest_state(ck)["samples_in_epoch"] == 0


def test_keep_global_batch_accumulates_to_the_checkpoints_batch(data_dir: Path, tmp_path: Path,
                                                                inprocess: None) -> None:
    """A checkpoint of global batch 128 resumed on one process of --batch-size 64: two micro-batches per step,
    the same step count and the same weights as a single process with batch 128 (GroupNorm: no batch stats)."""
    common = ["--model", "resnet20-gn", "--epochs", "2", "--lr", "0.05"]
    start, straight, healed = tmp_path / "start", tmp_path / "straight", tmp_path / "healed"
    assert main([*base_args(data_dir, start, *common, "--batch-size", "128", "--max-steps", "2")]) == 0
    subprocess.run(["cp", "-r", str(start), str(straight)], check=True)
    subprocess.run(["cp", "-r", str(start), str(healed)], check=True)
    assert main([*base_args(data_dir, straight, *common, "--batch-size", "128", "--resume")]) == 0
    assert main([*base_args(data_dir, healed, *common, "--batch-size", "64", "--resume",
                            "--keep-global-batch")]) == 0
    a, b = newest_state(straight), newest_state(healed)
    assert a["step"] == b["step"] == 8 and b["global_batch"] == 128
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-3, atol=2e-4)


def test_keep_global_batch_splits_over_the_processes_or_is_refused(data_dir: Path, tmp_path: Path) -> None:
    """A unit case: one process divides any batch, so the worlds here are made up."""
    ck = tmp_path / "ck"
    from trainer.__main__ import _batch_split
    from trainer.config import parse
    from trainer.dist import DistContext
    from trainer.errors import ConfigError

    cfg, _ = parse(base_args(data_dir, ck, "--batch-size", "16", "--resume", "--keep-global-batch"))
    with pytest.raises(ConfigError, match="does not split evenly over 3 processes"):
        _batch_split(cfg, DistContext(0, 0, 3, torch.device("cpu")), 50)
    assert _batch_split(cfg, DistContext(0, 0, 2, torch.device("cpu")), 50) == (25, 16)
    assert _batch_split(cfg, DistContext(0, 0, 2, torch.device("cpu")), 32) == (16, 0)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"trainer ended early:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not seen in {path} within {timeout} s")


def test_sigusr1_writes_every_threads_stack_into_log_dir(data_dir: Path, tmp_path: Path) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out.txt"
    logs.mkdir()
    env = {**child_env(), "LOG_DIR": str(logs)}
    proc = _start(base_args(data_dir, tmp_path / "ck", "--epochs", "1000", "--batch-size", "16"), env, out)
    try:
        _wait_for(out, "epoch 1 step 3 ", proc)
        proc.send_signal(signal.SIGUSR1)
        _wait_for(logs / "stack-rank0.txt", "trainer/__main__.py", proc, timeout=30)
        assert proc.poll() is None  # a dump, not a death
    finally:
        proc.kill()
        proc.wait(timeout=30)
    dump = (logs / "stack-rank0.txt").read_text()
    assert "trainer/loop.py" in dump and "Current thread" in dump


def test_injected_crash_fails_at_its_step(data_dir: Path, tmp_path: Path) -> None:
    """The crash the cluster tests plant (tests/programs/crash_at_step) fails the run at its step, no later."""
    env = {**child_env(), crash_at_step.ENV: "3"}
    ck = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(CRASH_PROGRAM), *base_args(data_dir, ck, "--epochs", "1",
                                                                      "--batch-size", "16")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "injected crash at step 3" in proc.stderr
    assert "epoch 1 step 3 " not in proc.stderr  # it died at the step, before its log line
