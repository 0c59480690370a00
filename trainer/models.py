"""Models for 32x32 inputs: CIFAR ResNet-18 (3x3 stem, no max-pool), ResNet-20, GroupNorm variants, a tiny CNN,
and a ViT at CIFAR size (4x4 patches) with about 2.3x ResNet-18's parameters, for --strategy fsdp.

torchvision models are available by name when torchvision is installed (they expect larger inputs: the
ImageNet stem downsamples 32x32 images 4x at once, which costs accuracy; resnet18 here is the CIFAR variant).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import MODEL_NAMES, Config
from .errors import ConfigError

log = logging.getLogger(__name__)

Norm = Callable[[int], nn.Module]


def batch_norm(ch: int) -> nn.Module:
    return nn.BatchNorm2d(ch)


def group_norm(ch: int) -> nn.Module:
    # Statistics per sample: the result does not depend on how the batch is split over ranks.
    return nn.GroupNorm(min(8, ch), ch)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet with a 3x3 stride-1 stem and no max-pool, so 32x32 inputs keep their resolution early on."""

    def __init__(self, widths: list[int], blocks: list[int], norm: Norm, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), norm(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks, strict=True)):
            for j in range(n):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1, norm))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _resnet_head(self, self.layers(_resnet_stem(self, x)))


# What runs before the first block and after the last, on any module that holds the model's attributes under their
# names: the model itself, or a pipeline stage cut from it (trainer/pipeline.py). getattr: a stage is no CifarResNet.
def _resnet_stem(m: nn.Module, x: torch.Tensor) -> Any:
    return getattr(m, "stem")(x)  # noqa: B009


def _resnet_head(m: nn.Module, x: torch.Tensor) -> Any:
    return getattr(m, "fc")(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))  # noqa: B009


class TinyCNN(nn.Module):
    """A few thousand parameters with GroupNorm: for tests and smoke runs on CPU."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1), group_norm(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, 1, 1), group_norm(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, 1, 1), group_norm(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.body(x), 1))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CifarViT(nn.Module):
    """ViT on 32x32 images with 4x4 patches (64 tokens), mean-pooled head; no BatchNorm, so nothing per rank
    drifts. dim 512, depth 8: 25.3M parameters, 2.3x the CIFAR ResNet-18, all of it in uniform blocks (the
    natural FSDP units). Widen it (dim, depth) to make memory the limit on a GPU: parameters, gradients and
    SGD momentum grow as 12 x dim^2 x depth x 3 x 4 bytes, sharded 1/world under FSDP."""

    def __init__(self, dim: int = 512, depth: int = 8, heads: int = 8, patch: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (32 // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _vit_head(self, self.blocks(_vit_stem(self, x)))


def _vit_stem(m: nn.Module, x: torch.Tensor) -> Any:
    return getattr(m, "patch")(x).flatten(2).transpose(1, 2) + getattr(m, "pos")  # noqa: B009


def _vit_head(m: nn.Module, x: torch.Tensor) -> Any:
    return getattr(m, "head")(getattr(m, "norm")(x).mean(dim=1))  # noqa: B009


@dataclass(frozen=True)
class Pipelined:
    """How --pp cuts a model: the attributes before its blocks (with the first stage), the nn.Sequential of blocks
    (split between the stages), the attributes after them (with the last), and what runs at either end."""

    stem: tuple[str, ...]
    blocks: str
    head: tuple[str, ...]
    run_stem: Callable[[nn.Module, torch.Tensor], Any]
    run_head: Callable[[nn.Module, torch.Tensor], Any]


PIPELINED: dict[type[nn.Module], Pipelined] = {
    CifarResNet: Pipelined(("stem",), "layers", ("fc",), _resnet_stem, _resnet_head),
    CifarViT: Pipelined(("patch", "pos"), "blocks", ("norm", "head"), _vit_stem, _vit_head),
}


# The residual blocks FSDP shards one by one (trainer/parallel.py).
BLOCK_TYPES: tuple[type[nn.Module], ...] = (BasicBlock, ViTBlock)

_R18 = ([64, 128, 256, 512], [2, 2, 2, 2])
_R20 = ([16, 32, 64], [3, 3, 3])
# Keyed by config.MODEL_NAMES, the torch-free list the orchestrator checks too (a test keeps them equal).
OWN_MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: CifarResNet(*_R18, batch_norm),
    "resnet18-gn": lambda: CifarResNet(*_R18, group_norm),
    "resnet20": lambda: CifarResNet(*_R20, batch_norm),
    "resnet20-gn": lambda: CifarResNet(*_R20, group_norm),
    "tiny": TinyCNN,
    "vit-cifar": CifarViT,
}


def _torchvision_names() -> list[str] | None:
    try:
        import torchvision.models as tvm
    except ImportError:
        return None
    return sorted(tvm.list_models(module=tvm))


def check_name(name: str) -> None:
    """Refuse an unknown model before any data is read."""
    if name in OWN_MODELS:
        return
    tv = _torchvision_names()
    if tv is None:
        raise ConfigError(
            f"--model {name!r} is not a model: choose one of {', '.join(MODEL_NAMES)} "
            f"(other names need torchvision installed)"
        )
    if name not in tv:
        raise ConfigError(f"--model {name!r} is not a model: choose one of {', '.join(MODEL_NAMES)} or a torchvision classification model")


def build(name: str, num_classes: int = 10) -> nn.Module:
    check_name(name)
    if name in OWN_MODELS:
        return OWN_MODELS[name]()
    import torchvision.models as tvm

    return tvm.get_model(name, weights=None, num_classes=num_classes)


def for_run(cfg: Config) -> nn.Module:
    """Same initial weights on every rank (seeded); SyncBatchNorm swapped in before the move and the DDP wrap."""
    torch.manual_seed(cfg.seed)
    model = build(cfg.model)
    if cfg.sync_bn:
        if not has_batch_norm(model):
            log.warning("--sync-bn: model %s has no BatchNorm layers; nothing to synchronise", cfg.model)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
