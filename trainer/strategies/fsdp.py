"""--strategy fsdp: parameters, gradients and optimizer state sharded by FSDP2 (trainer/parallel.py says how);
checkpoints are DCP folders every rank writes its shards into. The step and evaluation are DDP's, on the
sharded model (evaluation in lockstep: every forward all-gathers)."""

from __future__ import annotations

from .ddp import DDPStrategy


class FSDPStrategy(DDPStrategy):
    # state.build shards the model and snapshot.restore reads DCP folders for this config; what differs in the
    # loop is the checkpoint format.
    sharded_checkpoints = True
