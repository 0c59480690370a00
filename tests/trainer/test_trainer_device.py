"""Which options a rank's device accepts, and the memory layout it gets (trainer/device.py). Unit: torch.cuda's
probes are monkeypatched where a CUDA branch is taken; nothing runs on a GPU."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch
from kit.trainer_helpers import CPU, GPU3, unit_cfg, unit_ctx

from trainer import device
from trainer.config import cuda_only
from trainer.errors import ConfigError, DeviceError


@pytest.mark.parametrize("opts", [{"sync_bn": True}, {"grad_compression": "bf16"}, {"grad_compression": "fp16"}])
def test_cuda_only_options_are_accepted_on_cuda_and_refused_on_cpu(opts: dict[str, Any]) -> None:
    device.check_device(unit_cfg(**opts), unit_ctx(GPU3))
    if opts != {"grad_compression": "fp16"}:  # fp16 compression also runs on gloo
        with pytest.raises(DeviceError, match="CUDA"):
            device.check_device(unit_cfg(**opts), unit_ctx(CPU))


def test_fp16_runs_on_the_cpu_too() -> None:
    """torch has fp16 autocast and a GradScaler on the CPU (tests/trainer/test_trainer_fp16_cpu.py runs them)."""
    device.check_device(unit_cfg(precision="fp16"), unit_ctx(CPU))
    assert cuda_only(unit_cfg(precision="fp16")) == []  # the orchestrator accepts it with --gpus 0 from this table


def test_bf16_on_a_pre_ampere_gpu_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (7, 0))
    with caplog.at_level(logging.WARNING):
        device.check_device(unit_cfg(precision="bf16"), unit_ctx(GPU3))
    assert "emulated and slow" in caplog.text


def test_apex_missing_is_refused_before_the_data_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "apex", None)  # import apex -> ImportError, whatever is installed
    with pytest.raises(ConfigError, match="NVIDIA apex.*--optimizer sgd"):
        device.check_device(unit_cfg(optimizer="apex-fused-sgd"), unit_ctx(GPU3))


def test_channels_last_on_cuda_only() -> None:
    assert device.memory_format(GPU3) == torch.channels_last
    assert device.memory_format(CPU) == torch.contiguous_format
