"""The layers of docs/orchestrate.md beyond the imports: the pure plan loads neither SSH nor Docker at run time, and an
allocator is named nowhere but in its folder and its registration (import-linter's contracts in .importlinter hold
the imports between the folders; this holds what an import really loads, and the names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PLAN_MODULES = ("orchestrate.plan.jobplan", "orchestrate.plan.verdicts", "orchestrate.plan.gpuset",
                "orchestrate.plan.ports", "orchestrate.plan.gpus", "orchestrate.plan.transport")


def test_importing_the_plan_loads_no_ssh_and_no_docker() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in PLAN_MODULES)
            + "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('docker', 'paramiko')"
              " or m.startswith('orchestrate.remote.') and m != 'orchestrate.remote.identity')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []


def test_importing_the_backend_protocol_loads_no_ssh_and_no_docker() -> None:
    """The protocol is generic over the connection (issue 43): a second scheduler, or a program that only types
    against it, need not load paramiko and docker-py, which the Docker-over-SSH scheduler alone brings."""
    code = ("import sys\nimport orchestrate.backends.protocol, orchestrate.probe.daemons\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('docker', 'paramiko')"
            " or m.startswith(('orchestrate.remote.', 'orchestrate.backends.docker_ssh', 'orchestrate.backends.slurm'))"
            " and m != 'orchestrate.remote.identity')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []


def test_an_allocator_is_named_only_in_its_folder_and_its_registration() -> None:
    """Slurm is one folder (backends/slurm/) and its line in ALLOCATORS: cli.py, jobs/ and every other file reach it
    through the Allocator protocol (the lint contract `through-the-allocator` holds the imports; this, the names in
    code, help texts and docstrings too)."""
    root = Path(__file__).resolve().parents[2] / "orchestrate"
    naming = {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()
              and "__pycache__" not in path.parts and path.relative_to(root).parts[:2] != ("backends", "slurm")
              and "slurm" in path.read_text(errors="replace").lower()}
    assert naming == {"backends/allocators.py"}
    registration = [line for line in (root / "backends" / "allocators.py").read_text().splitlines()
                    if "slurm" in line.lower()]
    assert registration == ["from orchestrate.backends.slurm import Slurm",
                            "ALLOCATORS: tuple[Allocator, ...] = (Slurm(),)"]


def test_every_decision_in_the_docs_table_is_made_where_it_says() -> None:
    """docs/orchestrate.md's "Where is X decided": each row's file exists under orchestrate/ and defines the
    function (or constant) it names first; a function moved or renamed without the table fails here."""
    import ast
    import re

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "orchestrate.md").read_text()
    table = text.split("### Where is X decided", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| decision")]
    assert len(rows) >= 10
    for row in rows:
        _, file_cell, function_cell = [c.strip() for c in row.strip("|").rsplit("|", 2)]
        path = root / "orchestrate" / file_cell.strip("`")
        name = re.match(r"`([A-Za-z_][A-Za-z0-9_]*)`", function_cell)
        assert path.is_file() and name, row
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert name.group(1) in defined, f"{file_cell} defines no {name.group(1)}"
