"""The strategy seam (trainer/strategy.py): what depends on the way a run is parallelised is decided in
trainer/strategies/, one module per way, never by testing --strategy's value elsewhere in trainer/."""

from __future__ import annotations

import re
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
# A comparison with the strategy's name or value, e.g. `cfg.strategy == "fsdp"`, `"fsdp" != strategy`.
NAME_TEST = re.compile(r"""strategy\s*[!=]=|[!=]=\s*\S*strategy\b|["'](ddp|fsdp)["']\s*(in|[!=]=)""")


def test_no_trainer_module_outside_the_strategies_tests_the_strategys_name() -> None:
    """config.py may define and validate the option; the other modules receive a decision (`sharded`)."""
    found = [f"{path.relative_to(TRAINER.parent)}:{n}: {line.strip()}"
             for path in sorted(TRAINER.rglob("*.py"))
             if path.parent.name != "strategies" and path.name != "config.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if NAME_TEST.search(line)]
    assert found == []
