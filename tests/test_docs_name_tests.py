"""Docs that say "tested" name the test (the house rule), and every test the docs name exists: a bare `test_name`
somewhere under tests/, a cited `tests/....py` as that file, and a cited `tests/....py::test_name` in that very file.
A renamed, moved or removed test cannot leave a claim behind with nothing under it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Where "tested" is not a claim about one behaviour: how the project tests, or a heading over named tests.
NOT_A_CLAIM = ("is tested on what real hosts give it", "is tested honestly", "a pass that\ntested nothing",
               "## How it is tested", "how they are tested", "Tested on this machine:")
NAMED_WITHIN = 4  # lines: the test's name follows its claim within the sentence
# Words of the form test_* that name no test of ours: the trainer's fields, a file of PyTorch's own tests.
NOT_OURS = {"test_acc", "test_batch", "test_fully_shard_mixed_precision"}


def defined_tests() -> set[str]:
    """The test functions and the test modules."""
    files = list((REPO / "tests").rglob("test_*.py"))
    return {p.stem for p in files} | {m for p in files for m in re.findall(r"^\s*def (test_\w+)", p.read_text(), re.M)}


def test_every_test_the_docs_name_exists() -> None:
    tests = defined_tests() | NOT_OURS
    missing = sorted({(doc.name, name) for doc in DOCS for name in re.findall(r"\b(test_\w+)\b", doc.read_text())
                      if name not in tests})
    assert missing == [], missing


# A cited file under tests/, with the test (or class) it names after `::` (a parametrized case's [id] left off)
CITED = re.compile(r"\b(tests/[\w/.-]+\.py)(?:::(\w+))?")


def wrong_citations(text: str) -> list[str]:
    """The citations in a doc's text of a file under tests/ that does not exist, or of a test (or class) that its
    file does not define."""
    wrong = []
    for path, name in CITED.findall(text):
        file = REPO / path
        if not file.is_file():
            wrong.append(f"{path}: no such file")
        elif name and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", file.read_text(), re.M):
            wrong.append(f"{path}::{name}: no such test in that file")
    return wrong


def test_every_cited_test_file_and_test_exists() -> None:
    wrong = [f"{doc.name}: {w}" for doc in DOCS for w in wrong_citations(doc.read_text())]
    assert wrong == [], "\n".join(wrong)


def test_a_citation_of_a_missing_file_or_of_a_test_in_the_wrong_file_is_found() -> None:
    here = "tests/test_docs_name_tests.py"
    assert wrong_citations(f"`{here}::test_every_cited_test_file_and_test_exists`, `{here}`") == []
    assert wrong_citations("`tests/cluster/test_nothing.py`") == ["tests/cluster/test_nothing.py: no such file"]
    assert wrong_citations(f"`{here}::test_the_throttled_node_is_named_then_nobody_and_tensorboard_serves_the_events`") \
        == [f"{here}::test_the_throttled_node_is_named_then_nobody_and_tensorboard_serves_the_events: no such test in "
            "that file"]


def test_every_tested_claim_names_its_test() -> None:
    unnamed = []
    for doc in DOCS:
        text = doc.read_text()
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if "tested" not in line.lower():
                continue
            around = "\n".join(lines[max(i - 1, 0):i + NAMED_WITHIN])
            if any(phrase in around for phrase in NOT_A_CLAIM):
                continue
            if not re.search(r"test_\w+|tests/\S+\.py", "\n".join(lines[i:i + NAMED_WITHIN])):
                unnamed.append(f"{doc.name}:{i + 1}: {line.strip()}")
    assert unnamed == [], "\n".join(unnamed)
