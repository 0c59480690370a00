"""Fixtures for tests on real simulated hosts (devcluster): netns + sshd + dockerd per host. Needs root.

The hosts look like machines as they come: sshd with OpenSSH's stock settings (MaxSessions 10,
MaxStartups 10:30:100, SFTP on as Debian ships it), login as the non-root user ``ddp`` (in the
``docker`` group, home ``/home/ddp``), Docker's socket at ``/var/run/docker.sock`` (root:docker 0660),
and a mount namespace per host: each host has its own ``/home``, ``/root``, ``/tmp``, ``/var/tmp``, ``/mnt``
and ``/run`` (its sshd, dockerd and containers all see the same ones). So tests need not give hosts
their own dirs: the orchestrator's defaults are per host, as on real machines.

Fixtures (all torn down at session end, even when tests fail; a `gc` at session start removes what a
killed earlier run left behind):

- ``_leave_nothing_running`` (autouse, every test here): once a test has ended, every orchestrator process it
  started through kit/orchestrate_kit.py (``start``, ``orchestrate``) or kit/logins.py that still runs is killed with its
  process group; when the test failed or timed out, every job container (label ``ddp-cifar.job``) on the hosts of
  every cluster of this session is removed too. Without it a failed test leaves its `up` and its job running, and
  every later `up` on those hosts is refused (master port in use). What it ended is printed in the test's report.

- ``cluster`` (session): a 2-host ``devcluster.Cluster`` on the defaults, shared by every test of the
  session. Tests that change it must undo what they did (remove their containers and files,
  ``link_up()``, ``start_docker()``), best in a ``finally``. Images loaded into its hosts stay.
- ``cluster_factory`` (session): ``cluster_factory(n_hosts, fresh=False, *, root_login=False, no_sftp=(),
  shared=None, gpus=0, seeded=None) -> Cluster``. ``fresh=False`` returns a cluster of that size and variant
  shared by the session (made on first use); ``fresh=True`` makes a new one for the caller (about 1 s), which may
  ``close()`` it itself. ``seeded`` (default: not fresh): every host starts with the CPU image (the tests'
  ``ddp-cifar:cpu``) loaded, from a seed made once per image build (devcluster/seed.py: 1 s per cluster instead
  of 27 s or more per host); a fresh cluster starts without images unless ``seeded=True``: the tests of the
  image transfer (first `up`, layer deltas, pull, the planned layers) run on hosts without it. Variants: ``root_login=True`` (log in as root), ``no_sftp=[1]`` (host 1's sshd
  has no sftp subsystem), ``shared="/mnt/shared"`` (one folder at that path on every host, as NFS), ``gpus=4`` (each host's simulated
  ``nvidia-smi`` reports 4 GPUs).
- ``cluster_no_sftp`` (session): 2 hosts, host 1 without SFTP. ``cluster_shared`` (session): 2 hosts
  sharing ``/mnt/shared``. ``cluster_root`` (session): 2 hosts, root login.

What a test uses from a ``Cluster`` (see docs/devcluster.md):

- ``c.hosts_file``: orchestrate hosts file, one ssh alias per line (``dc-<name>-h<i> slots=1``);
  ``c.write_hosts_file(path, slots=1, keys={0: {"data_dir": "/mnt/shared/data"}})`` writes another one.
- ``c.client_env()``: environment with ``HOME=c.home``, whose ``.ssh/config``, ``.ssh/known_hosts`` and
  ``.ssh/id_ed25519`` are the cluster's: paramiko (so the orchestrator and docker-py's ``ssh://``)
  resolves the aliases and checks host keys strictly. OpenSSH ignores $HOME: use
  ``c.ssh_argv(host, "cmd")`` (``ssh -F c.ssh_config alias cmd``).
- ``c.user`` (login user), ``c.shared`` (shared path or None), ``c.ssh_config``, ``c.known_hosts``,
  ``c.key`` (id_ed25519), ``c.dir`` (state folder), ``c.subnet``, ``c.gateway``.
- ``c.hosts[i]``: ``.name`` (alias), ``.addr``, ``.user``, ``.home`` ("/home/ddp"), ``.sftp``,
  ``.path("/home/ddp/x") -> Path`` (where a path as the host sees it lies on this machine: read files
  or plant them), ``.run(argv, user="root")`` (inside the host's namespaces; ``user=c.user`` or
  ``"nobody"`` runs as that account), ``.foreign_files("/home/ddp/data")`` (files there not owned by the
  login user: assert it is empty), ``.docker_sock``, ``.docker_host``, ``.docker_client()`` (local
  socket, for assertions), ``.link_down()``/``.link_up()`` (network drops),
  ``.stop_docker()``/``.start_docker()``.
- Fixtures of the orchestrator's tests (module-scoped): ``fresh`` (2 hosts of the module's own, without the image),
  ``target`` (the cluster they run on; ``cluster``
  unless a module overrides it), ``work`` (a folder per module, on the machine), ``data`` (a synthetic
  CIFAR-10 archive served over HTTP on the cluster's gateway address), ``hosts`` (the hosts file of
  ``target``, on the orchestrator's default dirs, which are per host).
- ``devcluster.tinyimage.load_tiny_image(client)``: a tiny local image (sh, sleep, ip...) when a test
  needs *an* image but not ``ddp-cifar:cpu``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path

import pytest
from kit.orchestrate_kit import Data, end_leftovers, remove_job_containers, serve_data, start_test_clock

from devcluster import Cluster
from devcluster.gc import gc

CPU_IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")  # the Makefile passes its CPU_IMAGE

ClusterFactory = Callable[..., Cluster]
FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Notes on the test whether its setup or its call failed (a pytest-timeout counts: it fails the call)."""
    report: pytest.TestReport = yield
    if report.when in ("setup", "call") and report.failed:
        item.stash[FAILED] = True
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The kit's waits are bounded by what is left of the test's budget from here (orchestrate_kit.bounded)."""
    start_test_clock()


@pytest.fixture(scope="session")
def _devcluster_session() -> Iterator[list[Cluster]]:
    """gc first (a killed earlier run), then hand out a list every cluster of the session goes into;
    at the end all of them are removed, and any trace left fails the session."""
    gc()
    made: list[Cluster] = []
    yield made
    leftovers = []
    for c in made:
        leftovers += [f"{c.name}: {t}" for t in c.close()]
    assert not leftovers, f"devcluster teardown left: {leftovers}"


@pytest.fixture(autouse=True)
def _leave_nothing_running(request: pytest.FixtureRequest, _devcluster_session: list[Cluster]) -> Iterator[None]:
    yield
    ended = end_leftovers()
    if request.node.stash.get(FAILED, False):
        live = [c for c in _devcluster_session if c.dir.is_dir()]  # a fresh cluster its test closed is gone
        ended += [f"container {name}" for c in live for name in remove_job_containers(c)]
    if ended:
        print("ended what the test left running: " + "; ".join(ended))


@pytest.fixture(scope="session")
def cluster_factory(_devcluster_session: list[Cluster]) -> ClusterFactory:
    kept: dict[tuple[object, ...], Cluster] = {}

    def make(n_hosts: int, fresh: bool = False, *, root_login: bool = False, no_sftp: Sequence[int] = (),
             shared: str | None = None, gpus: int = 0, seeded: bool | None = None) -> Cluster:
        seeded = not fresh if seeded is None else seeded
        key = (n_hosts, root_login, tuple(sorted(no_sftp)), shared, gpus, seeded)
        if not fresh and key in kept:
            return kept[key]
        c = Cluster.create(n_hosts, root_login=root_login, no_sftp=no_sftp, shared=shared, gpus=gpus,
                           images=(CPU_IMAGE,) if seeded else ())
        _devcluster_session.append(c)
        if not fresh:
            kept[key] = c
        return c

    return make


@pytest.fixture(scope="session")
def cluster(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(2)


@pytest.fixture(scope="session")
def cluster_no_sftp(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(2, no_sftp=[1])


@pytest.fixture(scope="session")
def cluster_shared(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(2, shared="/mnt/shared")


@pytest.fixture(scope="session")
def cluster_root(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(2, root_login=True)


@pytest.fixture(scope="module")
def fresh(cluster_factory: ClusterFactory, cpu_image: str) -> Iterator[Cluster]:
    """A 2-host cluster of the module's own whose daemons start without the image: the tests of the image transfer
    (a module's `target` returns it)."""
    c = cluster_factory(2, fresh=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(cluster: Cluster) -> Cluster:
    """The cluster a module's orchestrator tests run on; a module overrides it to use another one."""
    return cluster


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="module")
def data(target: Cluster, work: Path) -> Iterator[Data]:
    with serve_data(work / "served", target.gateway) as d:
        yield d


@pytest.fixture(scope="module")
def hosts(target: Cluster, work: Path) -> Path:
    return target.write_hosts_file(work / "hosts.txt")
