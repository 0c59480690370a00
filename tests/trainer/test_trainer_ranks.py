"""Every rank seen: the straggler named from the heartbeat (trainer/contract.py), every rank's timings gathered
through the agreement (trainer/ranktime.py), FLOPs and MFU (trainer/hardware.py), a heartbeat that stays small."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kit.trainer_helpers import REPO, base_args, child_env, torchrun_cmd
from torch.utils.flop_counter import FlopCounterMode

from trainer import dist, hardware, metrics, models
from trainer.contract import HEARTBEAT_FILE, Beat
from trainer.dist import DistContext
from trainer.straggler import STRAGGLER_RATIO, node_times, slowest


def _beat(work: list[float], per_node: int) -> Beat:
    return Beat(step=1, rank_work_s=tuple(work), ranks_per_node=per_node)


def _named_after(tmp_path: Path, windows: list[list[float]], per_node: int = 2) -> list[tuple[int, int] | None]:
    """(node, rank) that slowest() names on rank 0's heartbeat after each agreement window's own-work figures
    (seconds per step, index = rank) go through metrics.Heartbeat.ranks, as the trainer feeds them."""
    beat = metrics.Heartbeat(tmp_path, True, 1000, 1, 64)
    named = []
    for work in windows:
        beat.ranks([(0.2, w, 0.0) for w in work], per_node)
        found = slowest(beat.beat)
        named.append((found.node, found.rank) if found else None)
    return named


HEALTHY = [0.004, 0.0042, 0.0041, 0.0039, 0.004, 0.0043]  # 3 nodes of 2 ranks: a tiny model's few ms of own work


def test_the_straggler_is_named_with_its_node_when_clearly_slower_for_several_windows(tmp_path: Path) -> None:
    work = [0.10, 0.10, 0.11, 0.10, 0.10, 0.19]  # rank 5 at 1.9x the median
    beat = metrics.Heartbeat(tmp_path, True, 1000, 1, 64)
    for _ in range(3):
        beat.ranks([(0.2, w, 0.0) for w in work], 2)
    found = slowest(beat.beat)
    assert found is not None and found.line() == "slowest: node 2 rank 5, 1.9x the median step"
    assert slowest(_beat([0.1], 1)) is None and slowest(Beat(step=1)) is None  # one rank; no timings
    assert slowest(_beat(work, 2)) is None  # an older trainer's beat: no streaks, nobody named
    assert node_times(work, 2) == [0.10, 0.11, 0.19]


def test_one_noisy_window_names_nobody(tmp_path: Path) -> None:
    """A healthy rank preempted for one step: its window's mean own work 5x the median's (20 ms over 8 steps on
    4 ms), one window only, between healthy ones."""
    noisy = [*HEALTHY[:3], 0.02, *HEALTHY[4:]]
    assert _named_after(tmp_path, [HEALTHY, noisy, HEALTHY, HEALTHY, noisy, noisy, HEALTHY]) == [None] * 7


def test_a_gap_of_a_few_ms_is_never_a_straggler(tmp_path: Path) -> None:
    """2x the median, window after window, but only 4 ms more per step: not worth naming."""
    slower = [*HEALTHY[:5], 0.008]
    assert _named_after(tmp_path, [slower] * 6) == [None] * 6


def test_a_throttled_rank_is_named_within_three_windows_and_cleared_in_the_first_after(tmp_path: Path) -> None:
    throttled = [0.01, 0.011, 0.04, 0.045, 0.01, 0.012]  # node 1's two ranks 4x the median
    lifted = [0.01, 0.011, 0.012, 0.01, 0.01, 0.012]
    named = _named_after(tmp_path, [lifted] * 2 + [throttled] * 5 + [lifted] * 3)
    assert named == [None] * 4 + [(1, 3)] * 3 + [None] * 3


def test_the_first_healthy_window_clears_the_streak(tmp_path: Path) -> None:
    """Throttled x4, healthy, throttled: named in windows 3 and 4, then nobody, and the throttled window after
    the healthy one counts from 1 again (docs: "The first window it is not clearly slower clears it"), so it names
    nobody either. A streak that a healthy window only lowered would name node 1 again in the last window."""
    throttled = [0.01, 0.011, 0.04, 0.045, 0.01, 0.012]
    healthy = [0.01, 0.011, 0.012, 0.01, 0.01, 0.012]
    named = _named_after(tmp_path, [throttled] * 4 + [healthy, throttled])
    assert named == [None, None, (1, 3), (1, 3), None, None]


def test_a_straggler_that_moves_between_ranks_each_window_is_noise(tmp_path: Path) -> None:
    windows = [[0.05 if r == i % 6 else 0.01 for r in range(6)] for i in range(6)]
    assert _named_after(tmp_path, windows) == [None] * 6


def test_an_old_heartbeat_still_parses_and_a_new_one_round_trips() -> None:
    old = Beat.parse(json.dumps({"step": 5, "state": "training", "loss": 1.5}))
    assert old is not None and old.rank_work_s is None and old.mfu is None and slowest(old) is None
    new = Beat(step=7, rank_step_s=(0.2, 0.2), rank_work_s=(0.05, 0.1), rank_data_s=(0.0, 0.0), ranks_per_node=1,
               rank_score=(0.67, 1.33), node_score=(0.67, 1.33), mfu=0.41, rank_streak=(0, 3), rank_stage=(0, 1))
    assert Beat.parse(json.dumps(new.to_dict())) == new


def test_under_pp_the_slow_stage_is_named_with_its_node_and_rank(tmp_path: Path) -> None:
    """pp 2 x dp 2 on 2 nodes (stage = node here): rank 3, in stage 1, at 1.9x the median for 3 windows. Each
    stage's ranks wait on the slowest stage, so the line names the stage first; a stage list that is not one per
    rank (another job size's) is left out rather than misread."""
    beat = metrics.Heartbeat(tmp_path, True, 1000, 1, 64)
    for _ in range(3):
        beat.ranks([(0.2, w, 0.0) for w in (0.10, 0.10, 0.10, 0.19)], 2, (0, 0, 1, 1))
    found = slowest(beat.beat)
    assert found is not None and found.line() == "slowest: stage 1 (node 1 rank 3), 1.9x the median step"
    assert (found.node, found.rank, found.stage) == (1, 3, 1)
    beat.mark("training", step=24)
    read = Beat.parse((tmp_path / HEARTBEAT_FILE).read_text())
    assert read is not None and read.rank_stage == (0, 0, 1, 1)
    found = slowest(replace(beat.beat, rank_stage=(0, 1)))
    assert found is not None and found.line() == "slowest: node 1 rank 3, 1.9x the median step"


def test_on_one_node_the_stage_follows_the_pipeline_position(tmp_path: Path) -> None:
    """--pp 2 x dp 1 on one node: the stage follows the rank's pipeline position, not its node."""
    beat = metrics.Heartbeat(tmp_path, True, 1000, 1, 64)
    for _ in range(3):
        beat.ranks([(0.2, w, 0.0) for w in (0.30, 0.10)], 2, (0, 1))
    found = slowest(beat.beat)
    assert found is not None and found.line() == "slowest: stage 0 (node 0 rank 0), 1.5x the median step"


def test_a_64_rank_heartbeat_stays_a_few_kb(tmp_path: Path) -> None:
    beat = metrics.Heartbeat(tmp_path, True, 100, 1, 64)
    rows = [(0.123456789 + r * 1e-5, 0.0456789 + r * 1e-4, 0.00123456) for r in range(64)]
    beat.ranks(rows, 8)
    beat.mark("training", step=1)
    text = (tmp_path / HEARTBEAT_FILE).read_text()
    parsed = Beat.parse(text)
    assert parsed is not None and parsed.rank_work_s is not None and len(parsed.rank_work_s) == 64
    assert parsed.node_score is not None and len(parsed.node_score) == 8
    assert len(text) < 4096, len(text)


def test_every_ranks_times_ride_in_the_agreement_in_their_own_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 3 puts its figures at slots 3..5 after the 4 shared ones (2 flags, the loss's verdict, the
    slowest step); the MAX all_reduce (stood in for: the others' figures already there, as the other ranks'
    reduction would put them; another rank's slower step) hands every rank all of them."""
    def others_figures(t: torch.Tensor, op: object = None) -> None:
        t[3] = max(float(t[3]), 2.5)
        t[4 + 0:4 + 3] = torch.maximum(t[4:7], torch.tensor([0.1, 0.2, 0.3], dtype=t.dtype))
        t[4 + 6:4 + 9] = torch.tensor([0.7, 0.8, 0.9], dtype=t.dtype)

    monkeypatch.setattr(torch.distributed, "all_reduce", others_figures)
    ctx = DistContext(1, 1, 3, torch.device("cpu"))
    flags, diverged, slowest, times = dist.agree(ctx, torch.tensor(1.0), True, False, step_s=0.5,
                                                 times=(0.4, 0.5, 0.6))
    assert flags == (True, False) and not diverged and slowest == 2.5
    assert times == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])


def test_a_rank_with_slow_compute_is_named_though_every_ranks_step_takes_as_long(data_dir: Path,
                                                                                tmp_path: Path) -> None:
    """2 real ranks; rank 1's forward is 30 ms slower (slow_rank_worker.py). DDP's all-reduce makes rank 0 wait
    for it, so both ranks' steps take as long; their own work (data wait + forward) names rank 1. The heartbeat
    at step 32 shows steps 16-24 (the figures lag one window; the first window holds each rank's own start), and
    rank 1 named: clearly slower in the windows of steps 0-8, 8-16 and 16-24 (straggler.STRAGGLER_WINDOWS)."""
    cmd = torchrun_cmd(2, base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "16", "--max-steps", "32"),
                       entry=(str(Path(__file__).with_name("slow_rank_worker.py")),))
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    beat = Beat.parse((tmp_path / HEARTBEAT_FILE).read_text())
    assert beat is not None and beat.rank_step_s and beat.rank_work_s, beat
    found = slowest(beat)
    # Two ranks: the median is their mean, so the score stays under 2 however slow rank 1 is.
    assert found is not None and (found.node, found.rank) == (0, 1) and found.score >= STRAGGLER_RATIO, beat
    assert beat.rank_work_s[1] > beat.rank_work_s[0] + 0.02, beat
    assert abs(beat.rank_step_s[0] - beat.rank_step_s[1]) < 0.2 * max(beat.rank_step_s), beat


def test_under_pp_the_slow_stage_is_named_though_the_other_waits_for_it(data_dir: Path, tmp_path: Path) -> None:
    """`--pp 2` on 2 real ranks; the head (stage 1's, rank 1's) is 30 ms slower a micro-batch (slow_rank_worker.py).
    Stage 0 waits for stage 1's gradients inside the schedule's step; its own work is its stage's forwards only,
    so the heartbeat names stage 1, and stage 0's own work stays well under stage 1's."""
    args = [*base_args(data_dir, tmp_path, "--epochs", "2", "--batch-size", "2", "--max-steps", "32"),
            "--model", "resnet20-gn", "--pp", "2", "--pp-split", "uniform", "--pp-microbatches", "2"]
    proc = subprocess.run(torchrun_cmd(2, args, entry=(str(Path(__file__).with_name("slow_rank_worker.py")),)),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    beat = Beat.parse((tmp_path / HEARTBEAT_FILE).read_text())
    assert beat is not None and beat.rank_work_s and beat.rank_stage == (0, 1), beat
    found = slowest(beat)
    assert found is not None and found.line().startswith("slowest: stage 1 (node 0 rank 1), "), beat
    assert beat.rank_work_s[1] > beat.rank_work_s[0] + 0.04, beat


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "fp16", 756.5), ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H200 NVL", "fp32", 417.5), ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),
    ("NVIDIA L40S", "bf16", 362.05), ("Tesla T4", "bf16", None)])
def test_the_peak_table_matches_gpu_names(name: str, precision: str, tflops: float | None) -> None:
    assert hardware.peak_tflops(name, precision) == tflops


def test_the_gpu_benchmark_uses_the_trainers_table(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "bench" / "gpu_throughput.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_throughput", bench)  # its dataclass looks itself up there
    spec.loader.exec_module(bench)
    assert bench.peak_tflops is hardware.peak_tflops and not hasattr(bench, "PEAK_TFLOPS")


def test_flops_counted_on_the_meta_device_equal_a_real_count_and_give_mfu() -> None:
    model = models.build("resnet20")
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    assert hardware.flops_per_image("resnet20") == counter.get_total_flops() / 2
    speed = hardware.Speed(1e9, 1e12)
    assert speed.mfu(100.0) == pytest.approx(0.1) and hardware.Speed(1e9, None).mfu(100.0) is None
    assert hardware.mfu_text(None) == "n/a" and hardware.mfu_text(0.1234) == "12.3%"


def test_without_the_tensorboard_package_one_warning_and_no_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    with caplog.at_level(logging.WARNING):
        assert metrics.open_tensorboard(tmp_path, None) is None
    assert [r.message.startswith("no TensorBoard event files") for r in caplog.records] == [True]


def test_mfu_on_a_gpu_is_over_every_devices_peak_and_not_applicable_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path by construction (no GPU here): the name torch reports picks the peak, times the world size."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    speed = hardware.measure("tiny", torch.device("cuda", 3), "bf16", world_size=2)
    assert speed is not None and speed.peak_flops == 2 * 989.4e12
    assert speed.mfu(1000.0) == pytest.approx(1000.0 * hardware.flops_per_image("tiny") / (2 * 989.4e12))
    cpu = hardware.measure("tiny", torch.device("cpu"), "fp32", world_size=2)
    assert cpu is not None and cpu.mfu(1000.0) is None


def test_a_model_the_meta_device_cannot_count_leaves_mfu_out(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    def no_meta_kernel(name: str) -> float:
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend")

    monkeypatch.setattr(hardware, "flops_per_image", no_meta_kernel)
    with caplog.at_level(logging.WARNING):
        assert hardware.measure("tiny", torch.device("cpu"), "fp32", 1) is None
    assert "model FLOPs not counted" in caplog.text
