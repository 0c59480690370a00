"""Models, optimizer choice and the learning-rate schedule (unit tests)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainer import defaults, models
from trainer.config import MODEL_NAMES, Config
from trainer.errors import ConfigError
from trainer.loop import autocast, lr_at


@pytest.mark.parametrize("name", ["resnet18", "resnet20", "resnet20-gn", "tiny"])
def test_models_take_32x32_and_give_10_logits(name: str) -> None:
    model = models.build(name).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_cifar_resnet18_keeps_resolution_in_the_stem() -> None:
    m = models.build("resnet18")
    stem_conv = m.stem[0]
    assert stem_conv.kernel_size == (3, 3) and stem_conv.stride == (1, 1)
    assert not any(isinstance(x, torch.nn.MaxPool2d) for x in m.modules())
    assert 11.0e6 < sum(p.numel() for p in m.parameters()) < 11.4e6


def test_group_norm_variant_has_no_batch_norm() -> None:
    assert models.has_batch_norm(models.build("resnet20"))
    assert not models.has_batch_norm(models.build("resnet20-gn"))


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="--model 'vgg0' is not a model.*resnet18"):
        models.check_name("vgg0")


def test_the_torch_free_model_list_is_what_models_builds() -> None:
    """config.MODEL_NAMES is what the orchestrator checks without torch; models.py must build exactly those."""
    assert set(models.OWN_MODELS) == set(MODEL_NAMES)


def test_a_name_no_model_can_have_is_refused_by_the_config() -> None:
    """Not a trainer model and not shaped like a torchvision name: refused before torch or any data."""
    with pytest.raises(ConfigError, match="--model 'does-not-exist' is not a model.*resnet18"):
        Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), model="does-not-exist")


def test_lr_warms_up_linearly_then_decays_with_a_cosine() -> None:
    cfg = Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), lr=0.2, warmup_epochs=2, epochs=10)
    run = defaults.resolve(cfg, "cpu", False, 128)  # on CPU --lr is used as given
    assert lr_at(run, 0.0) == 0.0 and math.isclose(lr_at(run, 1.0), 0.1) and math.isclose(lr_at(run, 2.0), 0.2)
    assert math.isclose(lr_at(run, 6.0), 0.1) and lr_at(run, 10.0) < 1e-12
    assert all(lr_at(run, 2 + i * 0.5) >= lr_at(run, 2 + (i + 1) * 0.5) for i in range(16))


def test_autocast_bf16_on_cpu_computes_in_bf16() -> None:
    lin = torch.nn.Linear(4, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert lin(torch.ones(2, 4)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert lin(torch.ones(2, 4)).dtype == torch.float32
