"""No test hook in the product: orchestrate/ and trainer/ import no module of the tests and name none of their
switches. The tests reach the product only from outside: their own entry wrapping the CLI (tests/kit/
gated_orchestrate.py installs its Pauses) and their own program in the image (tests/programs/crash_at_step)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("orchestrate", "trainer")
TEST_WORDS = ("DDP_CIFAR_TEST_", "testgates")  # the env switches and the gate module the product once held


def _is_test_module(name: str) -> bool:
    """A dotted module name any part of which is a test module or the tests' kit."""
    return any(part.startswith("test") or part in ("kit", "conftest") for part in name.split("."))


def _imports(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            joined = base if base.endswith(".") else f"{base}."
            names += [base] + [joined + alias.name for alias in node.names]
    return names


def hooks_found(root: Path) -> dict[str, list[str]]:
    """What each product file holds of the tests: test modules imported, test words named, or its own test name."""
    found: dict[str, list[str]] = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            text = path.read_text(errors="replace")
            hits = [word for word in TEST_WORDS if word in text]
            if path.name.startswith("test"):
                hits.append("named test*")
            if path.suffix == ".py":
                hits += [f"import {name}" for name in _imports(ast.parse(text)) if _is_test_module(name)]
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


def test_the_product_imports_and_names_nothing_of_the_tests() -> None:
    assert hooks_found(REPO) == {}


def test_the_scan_sees_an_import_of_the_kit_and_a_test_switch(tmp_path: Path) -> None:
    """The scan itself: a planted import and a planted switch are each found (else an empty answer proves nothing)."""
    (tmp_path / "orchestrate").mkdir()
    (tmp_path / "trainer" / "sub").mkdir(parents=True)
    (tmp_path / "orchestrate" / "a.py").write_text("from kit.gated_orchestrate import CLAIM_GATE_ENV\n")
    (tmp_path / "trainer" / "sub" / "b.py").write_text("from . import testhooks\nX = 'DDP_CIFAR_TEST_CRASH'\n")
    (tmp_path / "trainer" / "testing_aid.sh").write_text("true\n")
    assert hooks_found(tmp_path) == {
        "orchestrate/a.py": ["import kit.gated_orchestrate", "import kit.gated_orchestrate.CLAIM_GATE_ENV"],
        "trainer/sub/b.py": ["DDP_CIFAR_TEST_", "import .testhooks"],
        "trainer/testing_aid.sh": ["named test*"],
    }
