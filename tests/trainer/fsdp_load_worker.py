"""Run under torchrun (any number of CPU processes): `fsdp_load_worker.py OUT.pt TRAINER-ARGS... --resume`.
Builds the trainer's FSDP state, restores the newest sharded checkpoint through the strategy's restore (the
trainer's own path, resharded to this world size), then gathers the full model state dict and the position
and writes them to OUT.pt (global rank 0)."""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import dist, strategies
from trainer.__main__ import exit_without_finalizing
from trainer.config import parse


def main() -> None:
    cfg, _ = parse(sys.argv[2:])
    ctx = dist.context_from_env(cfg.device)
    dist.init(ctx, cfg.dist_timeout)
    try:
        strategy = strategies.for_config(cfg)
        st = strategy.build(cfg, ctx)
        strategy.restore(cfg, ctx, st)
        full = get_model_state_dict(st.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            torch.save({"model": full, "step": st.pos.step, "sample": st.pos.sample, "epoch": st.pos.epoch},
                       sys.argv[1])
        dist.barrier(ctx)
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main()
    # gloo threads outlive the group: rank 1 died of SIGABRT at finalization once in CI (see its docstring).
    exit_without_finalizing(0)
