"""The strategies, one module each (trainer/strategy.py has the interface); the config chooses one, once."""

from __future__ import annotations

from ..config import Config
from ..strategy import Strategy
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy


def for_config(cfg: Config) -> Strategy:
    """--pp above 1: pipelining (with DDP or FSDP inside each stage, as --strategy says); else --strategy."""
    if cfg.pp > 1:
        # imported only for a pipelined run: torch.distributed.pipelining costs every process 1.1 s of CPU at its
        # start (measured in the CPU image), which DDP and FSDP ranks never need
        from .pp import PipelineStrategy
        return PipelineStrategy(cfg)
    return FSDPStrategy() if cfg.strategy == "fsdp" else DDPStrategy()
