"""DDP CIFAR-10 trainer: ``torchrun ... -m trainer`` or ``python -m trainer`` (see docs/trainer.md)."""

__version__ = "0.1.0"
