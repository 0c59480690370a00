"""The GPU tier (`make test-gpu`: `pytest -m gpu tests/trainer/gpu`): tests that run CUDA kernels and NCCL. They are
never collected by the default run (tests/conftest.py, pytest_ignore_collect); here, without CUDA, every one of them
FAILS with the reason (a GPU tier that skips on a machine without a GPU would pass having tested nothing)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def cuda_present() -> None:
    if not torch.cuda.is_available():
        pytest.fail(f"no CUDA here (torch {torch.__version__}, CUDA build {torch.version.cuda}): the GPU tier needs "
                    "a machine with an NVIDIA GPU and a CUDA build of torch", pytrace=False)
