"""The 2-worker split of the cluster tests (tests/conftest.py, CLUSTER_GROUPS): every cluster test module is in
exactly one worker's group, so a new module is placed on purpose, by its length, and never makes the session
clusters a second time on the other worker."""

from __future__ import annotations

import importlib.util
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


def test_every_cluster_module_is_in_exactly_one_group() -> None:
    groups = root_conftest().CLUSTER_GROUPS
    placed = [stem for stems in groups.values() for stem in stems]
    on_disk = sorted(p.stem for p in (TESTS / "cluster").glob("test_*.py"))
    assert sorted(placed) == on_disk


def test_a_cluster_test_runs_in_its_group_and_any_other_test_in_its_module() -> None:
    conftest = root_conftest()
    assert conftest.xdist_group_of("tests/cluster/test_eight_hosts.py::test_x") == "cluster-3-hosts"
    assert conftest.xdist_group_of("tests/cluster/test_orchestrate_up.py::test_x[a]") == "cluster-2-hosts"
    assert conftest.xdist_group_of("tests/trainer/test_trainer_fsdp.py::test_x") == "tests/trainer/test_trainer_fsdp.py"
