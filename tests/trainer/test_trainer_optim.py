"""The optimizer (trainer/optim.py): NVIDIA apex's FusedSGD when asked for, with a clear error where apex or its
CUDA extensions are missing. Unit: apex is faked or hidden; nothing runs on a GPU."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from kit.trainer_helpers import unit_cfg
from torch import nn

from trainer import optim
from trainer.errors import ConfigError


def test_apex_optimizer_without_apex_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="NVIDIA apex.*--optimizer sgd"):
        optim.build(unit_cfg(optimizer="apex-fused-sgd"), [nn.Parameter(torch.zeros(1))])


def _fake_apex(monkeypatch: pytest.MonkeyPatch, fused_sgd: type) -> None:
    apex, optimizers = types.ModuleType("apex"), types.ModuleType("apex.optimizers")
    optimizers.FusedSGD = fused_sgd  # type: ignore[attr-defined]
    apex.optimizers = optimizers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)


def test_apex_without_its_cuda_extensions_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoExtensions(torch.optim.SGD):
        def __init__(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("apex.optimizers.FusedSGD requires cuda extensions")  # as apex says it
    _fake_apex(monkeypatch, NoExtensions)
    with pytest.raises(ConfigError, match="requires cuda extensions.*--optimizer sgd"):
        optim.build(unit_cfg(optimizer="apex-fused-sgd"), [nn.Parameter(torch.zeros(1))])


def test_apex_fused_sgd_gets_the_sgd_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    class FusedSGD(torch.optim.SGD):
        pass
    _fake_apex(monkeypatch, FusedSGD)
    opt = optim.build(unit_cfg(optimizer="apex-fused-sgd", lr=0.3), [nn.Parameter(torch.zeros(1))])
    assert isinstance(opt, FusedSGD) and opt.defaults["lr"] == 0.3 and opt.defaults["nesterov"]
