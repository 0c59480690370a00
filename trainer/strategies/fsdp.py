"""--strategy fsdp: parameters, gradients and optimizer state sharded by FSDP2 (trainer/parallel.py says how);
checkpoints are DCP folders every rank writes its shards into. The step and evaluation are DDP's, on the
sharded model (evaluation in lockstep: every forward all-gathers)."""

from __future__ import annotations

from .. import snapshot, state
from ..config import Config
from ..dist import DistContext
from ..state import TrainState
from .ddp import DDPStrategy


class FSDPStrategy(DDPStrategy):
    sharded_checkpoints = True

    def build(self, cfg: Config, ctx: DistContext) -> TrainState:
        """Sharded before the optimizer sees the parameters; its SGD is foreach and its fp16 scaler the sharded
        one (optim.py, parallel.grad_scaler say why)."""
        return state.build(cfg, ctx, sharded=True)

    def wrap(self, cfg: Config, ctx: DistContext, st: TrainState) -> None:
        state.wrap(cfg, ctx, st, sharded=True)  # no DDP wrapper: the step calls the sharded model

    def restore(self, cfg: Config, ctx: DistContext, st: TrainState) -> int:
        """A DDP .pt loads by name into the shards (FSDP2 keeps the model's parameter names and order)."""
        return snapshot.restore(cfg, ctx, st, [n for n, _ in st.model.named_parameters()])
