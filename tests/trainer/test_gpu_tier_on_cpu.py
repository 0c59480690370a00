"""The GPU tier's gates and the GPU benchmark, on a machine without a GPU: the default run never collects the tier,
`pytest -m gpu` (make test-gpu) fails where CUDA is missing instead of passing having run nothing, and
bench/gpu_throughput.py runs tiny on the CPU, with its peak table and goals checked on the texts a GPU gives."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from kit.trainer_helpers import REPO, child_env

from trainer import gpuprobe


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    # CUDA hidden: the same answer on a machine with a GPU.
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_default_run_never_collects_the_gpu_tier_and_the_tier_fails_without_cuda() -> None:
    listed = _pytest("--collect-only", "-q", "tests/trainer")
    assert listed.returncode == 0 and "tests/trainer/test_gpu_tier_on_cpu.py" in listed.stdout, listed.stdout[-2000:]
    assert "tests/trainer/gpu/" not in listed.stdout
    tier = _pytest("-m", "gpu", "-q", "tests/trainer/gpu")
    assert tier.returncode == 1, tier.stdout[-2000:]
    assert "no CUDA here: torch " in tier.stdout and " passed" not in tier.stdout and "skipped" not in tier.stdout


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "bench" / "gpu_throughput.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_peak_table_knows_the_names_torch_gives_and_a_missed_goal_fails() -> None:
    bench = _bench()
    names = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835.5, "NVIDIA H200": 989.4,
             "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA L40S": 362.05, "Tesla T4": None}
    assert {name: bench.peak_tflops(name) for name in names} == names
    # Goals scaled by the GPU's peak: 40k images/s on an H100 SXM, 312/989.4 of it on an A100.
    assert bench.step_goal(989.4) == 40_000 and round(bench.step_goal(312.0)) == 12_614
    assert bench.step_goal(None) is None
    good = bench.figures("eager", bench.Figures(45_000, 42_000, 3.33e9, 989.4), True)
    assert all(f.within() for f in good) and good[0].bound == 40_000, good
    slow = bench.figures("eager", bench.Figures(30_000, 20_000, 3.33e9, 989.4), True)
    assert [f.name for f in slow if not f.within()] == ["eager step loop", "eager steady epochs"]
    a100 = bench.figures("eager", bench.Figures(23_000, 22_000, 3.33e9, 312.0), True)
    assert all(f.within() for f in a100)  # 23k is above an A100's scaled goal (12.6k)
    assert not all(f.within() for f in bench.figures("eager", bench.Figures(10_000, 9_500, 3.33e9, 312.0), True))
    assert "MFU 15.1%" in bench.report("eager", bench.Figures(45_000, 42_000, 3.33e9, 989.4))[0]


def test_the_gpu_benchmark_runs_tiny_on_the_cpu() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--device", "cpu",
                           "--steps", "2", "--warmup", "1", "--batch-size", "8", "--model", "tiny",
                           "--train-images", "256", "--epochs", "2"],
                          cwd=REPO, env={**child_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if ": " in line and not line.startswith("00:")]
    assert "device: cpu" in lines and any("GFLOP" in line for line in lines), done.stdout
    step = next(line for line in lines if line.startswith("eager: step loop:"))
    steady = next(line for line in lines if line.startswith("eager: steady epochs:"))
    assert float(step.split()[3]) > 0 and float(steady.split()[3]) > 0, done.stdout
    assert any(line.startswith("eager: start ") and "end " in line for line in lines), done.stdout
    assert "airbench" in done.stdout and "eager steady epochs:" in done.stdout  # bounds.py's figure lines


@pytest.mark.parametrize(("facts", "said"), [
    ({"torch": "2.13.0+cpu", "cuda": None}, "torch 2.13.0+cpu is a CPU build (no CUDA)"),
    ({"torch": "2.13.0+cu128", "cuda": "12.8", "driver_cuda": None, "cu_init": None},
     "no NVIDIA driver here (libcuda.so.1 not found; torch 2.13.0+cu128 is built for CUDA 12.8)"),
    # A fresh machine: CUDA 13 torch on a CUDA 12.8 driver (torch counts no GPU and only warns).
    ({"torch": "2.14.0+cu130", "cuda": "13.0", "driver_cuda": 12080, "driver": "570.124.06", "cu_init": 0,
      "count": 0, "warning": "The NVIDIA driver on your system is too old (found version 12080)"},
     "the driver 570.124.06 supports CUDA up to 12.8, torch 2.14.0+cu130 is built for CUDA 13.0: install a torch "
     "built for CUDA 12.x (e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)"),
    ({"torch": "2.13.0+cu128", "cuda": "12.8", "driver_cuda": 12080, "cu_init": 802,
      "cu_error": "CUDA_ERROR_SYSTEM_NOT_READY: system not yet initialized"},
     "CUDA does not start: error 802 CUDA_ERROR_SYSTEM_NOT_READY"),
])
def test_a_gpu_machine_without_usable_cuda_is_told_why(facts: dict, said: str) -> None:
    """The GPU tier's and scripts/gpu-check.sh's one line: before, "no CUDA here" for every cause."""
    assert gpuprobe.why_no_cuda(facts).startswith(said)


def test_the_gpu_check_refuses_a_machine_without_a_gpu_in_one_line(tmp_path: Path) -> None:
    """scripts/gpu-check.sh on this CPU machine: exit 2, one line saying why, nothing run, no report written."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(tmp_path / "report.txt")], cwd=REPO,
                          env={**child_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"gpu-check: no GPU to check: torch {torch.__version__} is a CPU build (no "
                                        "CUDA): this needs an NVIDIA GPU and a CUDA build of torch"], done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "report.txt").exists()
