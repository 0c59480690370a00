"""The strategy seam (trainer/strategy.py): what depends on the way a run is parallelised is decided in
trainer/strategies/, one module per way, never by testing --strategy's value elsewhere in trainer/."""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_a_ddp_rank_imports_neither_dcp_nor_pipelining() -> None:
    """Each strategy's heavy torch parts are imported by the strategy that uses them: a DDP rank that imported
    torch.distributed.checkpoint and .pipelining at its start would pay their import CPU at every (re)start of
    every rank (trainer/dcp_checkpoint.py, trainer/strategies/__init__.py). FSDP itself comes with torch's
    optimizers (their first call imports torch._dynamo, which imports it), so it is not asserted here."""
    probe = ("import sys, trainer.__main__\n"
             "from trainer import strategies\n"
             "from trainer.config import parse\n"
             "strategies.for_config(parse(['--data-dir', 'd', '--ckpt-dir', 'c', '--strategy', 'ddp'])[0])\n"
             "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.pipelining')"
             " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=TRAINER.parent, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
