"""Fixtures shared by every test folder.

- ``docker_client`` (session): a Docker SDK client of the local dockerd. When the daemon cannot be
  reached the test FAILS with the reason; it never skips, so CI cannot pass without a real engine.
- ``cpu_image`` (session): the tag ``ddp-cifar:cpu`` (or $DDP_TEST_IMAGE, so that parallel work trees can test
  images of their own); fails with "run make image-cpu" when it is missing.
- ``repo_root``: the repository's root folder (a Path).
- A skip fails the run (SkipsFail): a skipped test or module makes pytest exit 1, with xdist too (the controller
  sees the workers' reports), so CI cannot pass with a test that did not run. tests/test_skips_fail.py runs it.
- Ctrl-C as in a terminal: a suite started in the background of a shell without job control (``cmd &`` in a
  script) inherits SIGINT ignored, and so would every ``up`` it starts: the Ctrl-C test would see it ignored.

Parallel runs (pytest-xdist, ``make test TEST_WORKERS=N``): each test module is a unit of work, handed to the worker
that is free, longest first by CI's last measure (tests/durations.json; LongestFirstScheduling below). Every worker
makes the session clusters it needs (seeded hosts start in about a second), so any worker can take any module.
The run ends with a summary of where the time went (tests/kit/summary.py); ``--store-durations FILE`` also writes
each module's seconds to FILE, the form of tests/durations.json.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import docker.errors
import pytest
from kit.summary import RunSummary
from xdist.scheduler import LoadScopeScheduling

# Seconds each test module took in CI (setup + call + teardown of its tests, tests/durations.json, written by
# `pytest --store-durations tests/durations.json`): the scheduler below starts the longest modules first, so that the
# workers end together. A module missing from the file gets the estimate of its folder's; tests/test_worker_groups.py
# fails on a cluster module missing from it, so that a new one is measured and placed on purpose.
DURATIONS_FILE = Path(__file__).resolve().parent / "durations.json"
UNKNOWN_MODULE_S = {"tests/cluster/": 120.0, "tests/trainer/": 20.0, "tests/image/": 30.0}
# Modules whose tests share nothing but cheap module fixtures (a data server, a folder), each test starting its own
# job on the session's hosts: each test is a unit of work of its own, so that the longest modules (17 and 14 minutes
# of test time under load) spread over the workers instead of bounding the run.
SPLIT_MODULES = frozenset({"tests/cluster/test_self_healing.py", "tests/cluster/test_orchestrate_faults.py",
                           "tests/cluster/test_host_faults.py"})
CPU_IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")
REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", metavar="FILE", type=Path,
                     help="write each test module's seconds to FILE (JSON), as tests/durations.json holds them")


def pytest_configure(config: pytest.Config) -> None:
    # A handled signal is reset to its default in an exec'd child, an ignored one stays ignored: with a handler
    # here, the programs the tests start take Ctrl-C (KeyboardInterrupt) as they do when typed in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.pluginmanager.register(SkipsFail(), "skips-fail")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sees every worker's reports
        config.pluginmanager.register(RunSummary(store=config.getoption("store_durations"), unit_of=unit_of),
                                      "run-summary")


class SkipsFail:
    """Notes every skipped test or module (an xfail is not a skip) and turns a run that passed into a failure."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def _note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.append(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.skipped and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.skipped:
            terminalreporter.write_line(f"error: {len(self.skipped)} skipped ({', '.join(self.skipped)}): a skip "
                                        "fails this suite; make the test run here or remove it", red=True)


GPU_TIER = REPO_ROOT / "tests" / "trainer" / "gpu"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The GPU tier is collected only by `make test-gpu` (-m gpu): the default run neither runs nor skips it."""
    if collection_path == GPU_TIER and config.getoption("markexpr") != "gpu":
        return True
    return None


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(
            f"dockerd is unreachable ({e}); start it (e.g. `dockerd &` as root, or .ci/run) and rerun",
            pytrace=False,
        )
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def cpu_image(docker_client: docker.DockerClient) -> str:
    try:
        docker_client.images.get(CPU_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {CPU_IMAGE} is missing: run make image-cpu", pytrace=False)
    return CPU_IMAGE


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its module (a module's tests share its fixtures and may build on each other), or
    the test itself in a SPLIT_MODULES module."""
    return nodeid if module_of(nodeid) in SPLIT_MODULES else module_of(nodeid)


def estimated_seconds(unit: str, measured: dict[str, float]) -> float:
    """What a unit is expected to take: CI's last measure, else the estimate of its folder's modules."""
    if unit in measured:
        return measured[unit]
    return next((s for folder, s in UNKNOWN_MODULE_S.items() if unit.startswith(folder)), 5.0)


def longest_first(modules: list[str], measured: dict[str, float]) -> list[str]:
    """The modules in the order the workers take them: longest expected first (a stable sort: ties keep their order)."""
    return sorted(modules, key=lambda module: -estimated_seconds(module, measured))


class LongestFirstScheduling(LoadScopeScheduling):
    """xdist's load-by-module scheduling, with the work queue ordered by each module's expected length, longest
    first: a free worker takes the longest module left, so the last to end is a short one (LPT scheduling).

    Every worker makes the session clusters it needs (seeded hosts start in about a second, docs/devcluster.md), so
    any worker can run any cluster module. Not `--dist loadgroup` with xdist_group marks: pytest 9.2 ignores the
    node ids that mode rewrites, and the tests would be spread round-robin (pytest-dev/pytest-xdist#1386)."""

    ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: object) -> None:
        if not self.ordered:
            measured = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}
            units = dict(self.workqueue)
            self.workqueue.clear()
            self.workqueue.update((module, units[module]) for module in longest_first(list(units), measured))
            self.ordered = True
        super()._assign_work_unit(node)  # type: ignore[arg-type]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LongestFirstScheduling:
    return LongestFirstScheduling(config, log)  # type: ignore[arg-type]


NOBODY = "nobody"  # an account without privileges, present on every Debian system (uid 65534)
# The system's interpreter of this venv's Python version: the venv's own links into root's home (pyenv), which
# `nobody` cannot enter. The venv's packages are pure Python or built for this version, so they load in it.
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")


@pytest.fixture
def run_as_nobody(repo_root: Path) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """`run_as_nobody(args, cwd)`: `python ARGS` (this repository and the venv's packages importable) as the
    unprivileged account `nobody`, for what only a non-root account sees: root reads and enters anything, whatever
    its mode. Fails, never skips, when the system has no interpreter of this version. A clone in a folder only
    root may enter (`mktemp -d` makes them mode 700) is made enterable (o+x on that folder alone, never readable)
    for the test's length, then set back."""
    if not SYSTEM_PYTHON.is_file():
        pytest.fail(f"{SYSTEM_PYTHON} is missing: the tests run as `nobody` need it (apt-get install python3)",
                    pytrace=False)
    roots = [repo_root, Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])]
    path = os.pathsep.join(str(r) for r in roots)
    closed = {d: d.stat().st_mode for r in roots for d in (r, *r.parents) if not d.stat().st_mode & stat.S_IXOTH}

    def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "HOME": str(cwd), "OMP_NUM_THREADS": "1"}
        return subprocess.run([str(SYSTEM_PYTHON), *args], user=NOBODY, group=pwd.getpwnam(NOBODY).pw_gid, extra_groups=[], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=120)

    try:
        for folder, mode in closed.items():
            folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        yield run
    finally:
        for folder, mode in closed.items():
            folder.chmod(stat.S_IMODE(mode))


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder the account `nobody` may enter (pytest's own tmp folders are mode 700): for the tests that run a
    program as `nobody`, since root reads and enters anything whatever its mode."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-cifar-test-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
