"""Fixtures for the trainer tests: small synthetic data; in-process runs keep pytest's SIGTERM handler."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kit.trainer_helpers import N_TEST, N_TRAIN

from trainer.data import write_synthetic

# One thread per process: the CI machine has 2 shared cores, and oversubscription makes CPU training 5x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cifar")
    write_synthetic(out, N_TRAIN, N_TEST, seed=1)
    return out


@pytest.fixture
def inprocess() -> Iterator[None]:
    """For running trainer.__main__.main() inside pytest: afterwards put pytest's SIGTERM handler back and
    drop the log handler main() installed (it points at this test's captured stderr)."""
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_trainer", False):
            root.removeHandler(h)
    root.setLevel(logging.WARNING)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA missing, on any machine: for the tests of what the trainer does without it (on a GPU machine torch
    would find it; the GPU tier, tests/trainer/gpu, tests what it does with it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
