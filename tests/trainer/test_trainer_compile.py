"""--compile: torch.compile of the module the training step calls (trainer/state.py, `wrap`), on the CPU.

inductor compiles tiny's forward and backward in ~56 s on this 2-core machine (measured under load): too slow for
CI, so the tests use aot_eager, which runs the same capture (dynamo) and the same forward/backward split
(AOTAutograd) without generating kernels. What inductor's kernels compute is for the GPU benchmark to show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kit.trainer_helpers import base_args, newest_state
from torch._dynamo.utils import counters

from trainer.__main__ import main
from trainer.config import Config
from trainer.errors import ConfigError


def test_a_compiled_run_trains_as_the_eager_one_and_saves_the_same_keys(data_dir: Path, tmp_path: Path,
                                                                        inprocess: None) -> None:
    """Same seed and data: the compiled run's weights after 8 steps equal the eager run's within float
    tolerance, and its checkpoint has the plain module's keys (no `_orig_mod.`: the compiled wrapper is never
    what is saved)."""
    runs, graphs = {}, {}
    for mode in ("off", "aot_eager"):
        ck = tmp_path / mode
        counters.clear()
        assert main(base_args(data_dir, ck, "--epochs", "1", "--batch-size", "64", "--compile", mode)) == 0
        runs[mode], graphs[mode] = newest_state(ck)["model"], counters["stats"]["unique_graphs"]
    assert graphs["off"] == 0 and graphs["aot_eager"] >= 1  # the step really ran a captured graph
    eager, compiled = runs["off"], runs["aot_eager"]
    assert list(compiled) == list(eager) and not any("_orig_mod" in k for k in compiled)
    for key in eager:
        assert torch.allclose(eager[key], compiled[key], atol=1e-4), f"{key}: {(eager[key] - compiled[key]).abs().max()}"
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in compiled.values())


def test_compile_is_refused_with_fsdp_and_an_unknown_backend() -> None:
    with pytest.raises(ConfigError, match="--strategy fsdp cannot honour --compile"):
        Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), strategy="fsdp", compile="inductor")
    with pytest.raises(ConfigError, match="--compile must be one of off, inductor, aot_eager"):
        Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), compile="cudagraphs")
