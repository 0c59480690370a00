"""The GPU tier (`make test-gpu`: `pytest -m gpu tests/trainer/gpu`): tests that run CUDA kernels and NCCL. They are
never collected by the default run (tests/conftest.py, pytest_ignore_collect); here, without CUDA, every one of them
FAILS with the reason (a GPU tier that skips on a machine without a GPU would pass having tested nothing): a CPU
build of torch, no driver, or a torch built for a newer CUDA major than the driver supports (trainer/gpuprobe.py,
why_no_cuda)."""

from __future__ import annotations

import pytest
import torch

from trainer import gpuprobe


@pytest.fixture(autouse=True, scope="session")
def cuda_present() -> None:
    if not torch.cuda.is_available():
        pytest.fail(f"no CUDA here: {gpuprobe.why_no_cuda(gpuprobe.probe())}", pytrace=False)
