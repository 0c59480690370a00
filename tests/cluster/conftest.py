"""Fixtures for tests on real simulated hosts (devcluster): netns + sshd + dockerd per host. Needs root.

Fixtures (all torn down at session end, even when tests fail; a `gc` at session start removes what a
killed earlier run left behind):

- ``cluster`` (session): a 2-host ``devcluster.Cluster``, shared by every test of the session.
  Tests that change it must undo what they did (remove their containers, ``link_up()``,
  ``start_docker()``), best in a ``finally``. Images loaded into its hosts stay between tests.
- ``cluster_factory`` (session): ``cluster_factory(n_hosts, fresh=False) -> Cluster``.
  ``fresh=False`` returns a cluster of that size shared by the session (made on first use);
  ``fresh=True`` makes a new one for the caller (about 1 s), which may ``close()`` it itself.

What a test uses from a ``Cluster`` (see docs/devcluster.md):

- ``c.hosts_file``: orchestrate hosts file, one ssh alias per line (``dc-<name>-h<i> slots=1``);
  ``c.write_hosts_file(path, slots=1, keys={0: {"data_dir": "/tmp/x"}})`` writes another one.
- ``c.client_env()``: environment with ``HOME=c.home``, whose ``.ssh/config``, ``.ssh/known_hosts`` and
  ``.ssh/id_ed25519`` are the cluster's: paramiko (so the orchestrator and docker-py's ``ssh://``)
  resolves the aliases and checks host keys strictly. OpenSSH ignores $HOME: use
  ``c.ssh_argv(host, "cmd")`` (``ssh -F c.ssh_config alias cmd``).
- ``c.ssh_config``, ``c.known_hosts``, ``c.key`` (id_ed25519), ``c.dir`` (state folder), ``c.subnet``.
- ``c.hosts[i]``: ``.name`` (alias), ``.addr``, ``.netns``, ``.docker_sock``, ``.docker_host``,
  ``.docker_client()`` (local socket, for assertions), ``.run(argv)`` (inside the netns),
  ``.link_down()``/``.link_up()`` (network drops), ``.stop_docker()``/``.start_docker()``.
- Fixtures of the orchestrator's tests (module-scoped): ``target`` (the cluster they run on; ``cluster``
  unless a module overrides it), ``work`` (a folder per module), ``data`` (a synthetic CIFAR-10 archive
  served over HTTP on the cluster's gateway address), ``hosts`` (a hosts file giving each host its own
  data/checkpoint/log dirs under ``work``).
- ``devcluster.tinyimage.load_tiny_image(client)``: a tiny local image (sh, sleep, ip...) when a test
  needs *an* image but not ``ddp-cifar:cpu``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from orchestrate_kit import Data, host_dirs, serve_data

from devcluster import Cluster
from devcluster.gc import gc

ClusterFactory = Callable[..., Cluster]


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


@pytest.fixture(scope="session")
def cluster_factory(_devcluster_session: list[Cluster]) -> ClusterFactory:
    shared: dict[int, Cluster] = {}

    def make(n_hosts: int, fresh: bool = False) -> Cluster:
        if not fresh and n_hosts in shared:
            return shared[n_hosts]
        c = Cluster.create(n_hosts)
        _devcluster_session.append(c)
        if not fresh:
            shared[n_hosts] = c
        return c

    return make


@pytest.fixture(scope="session")
def cluster(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(2)


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
    return target.write_hosts_file(work / "hosts.txt", keys=host_dirs(work, 2))
