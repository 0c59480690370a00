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
- ``devcluster.tinyimage.load_tiny_image(client)``: a tiny local image (sh, sleep, ip...) when a test
  needs *an* image but not ``ddp-cifar:cpu``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

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
