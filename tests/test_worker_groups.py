"""The order in which the workers take the test modules (tests/conftest.py, LongestFirstScheduling): longest first by
CI's last measure (tests/durations.json), so that a long module never starts last and the workers end together."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent


def root_conftest() -> ModuleType:
    # Loaded by path: pytest imports every conftest.py as `conftest`, so the name does not say which one it is.
    spec = importlib.util.spec_from_file_location("root_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_cluster_module_has_a_measured_length() -> None:
    """A new cluster module is measured (`--store-durations`) and placed by its length, not guessed."""
    measured = {unit.split("::", 1)[0] for unit in json.loads((TESTS / "durations.json").read_text())}
    on_disk = sorted(f"tests/cluster/{p.name}" for p in (TESTS / "cluster").glob("test_*.py"))
    assert [m for m in on_disk if m not in measured] == []


def test_the_longest_module_is_handed_out_first_and_a_test_stays_with_its_module() -> None:
    conftest = root_conftest()
    measured = {"tests/cluster/test_long.py": 300.0, "tests/test_short.py": 1.0}
    order = conftest.longest_first(["tests/test_kit.py", "tests/test_short.py", "tests/cluster/test_new.py",
                                    "tests/trainer/test_new.py", "tests/cluster/test_long.py"], measured)
    # measured first by their seconds; unmeasured ones by their folder's estimate (cluster 120, trainer 20, else 5)
    assert order == ["tests/cluster/test_long.py", "tests/cluster/test_new.py", "tests/trainer/test_new.py",
                     "tests/test_kit.py", "tests/test_short.py"]
    assert conftest.unit_of("tests/cluster/test_sixteen_hosts.py::test_x[a]") == "tests/cluster/test_sixteen_hosts.py"
    # a test of a module whose tests share nothing costly is a unit of its own
    assert conftest.unit_of("tests/cluster/test_self_healing.py::test_x") == "tests/cluster/test_self_healing.py::test_x"
