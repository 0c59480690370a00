"""Two `up`s into one data folder at the same moment, on 2 stock test hosts (real sshd, dockerd, torchrun): one
download (or one send) per host, one verified copy, both jobs train to the end (docs/shared-hosts.md).

"The same moment" is made certain rather than likely: the fetch test's HTTP server holds the first download on
each host until the other `up` says it waits (or, with no lock in the code, downloads too); the staging test
takes each folder's lock itself, over SSH as the login, exactly as `up` does, and lets go once both `up`s say
they wait.
"""

from __future__ import annotations

import http.server
import queue
import shlex
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
from kit.fetching import serving
from kit.orchestrate_kit import (
    IMAGE,
    PATIENCE,
    SHARED_CORES,
    TRAIN,
    Data,
    Up,
    example_image,
    kill_process_group,
    start,
    wait_for,
)

from devcluster import Cluster, Host
from orchestrate.backends.docker_ssh import datalock

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]


class Gated(http.server.SimpleHTTPRequestHandler):
    """Records every GET's client address and holds its answer until the gate opens (bounded)."""

    gets: list[str] = []
    gate = threading.Event()

    def do_GET(self) -> None:
        Gated.gets.append(self.client_address[0])
        Gated.gate.wait(timeout=PATIENCE)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def gated(folder: Path, bind: str) -> Iterator[str]:
    """An HTTP server of `folder` whose downloads wait for Gated.gate; yields its base URL."""
    Gated.gets, Gated.gate = [], threading.Event()
    with serving(partial(Gated, directory=str(folder)), bind) as base:
        try:
            yield base
        finally:
            Gated.gate.set()


@contextmanager
def held(cluster: Cluster, folder: str) -> Iterator[None]:
    """Every host's `folder` (made as the login) locked by the test, as `up` locks it, until the body ends."""
    holders = []
    for host in cluster.hosts:
        remote = f"mkdir -p -- {shlex.quote(folder)} && " + shlex.join(
            ["sh", "-c", datalock.SCRIPT, "data-lock", folder, "600"])
        proc = subprocess.Popen(cluster.ssh_argv(host, remote), env=cluster.client_env(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda p=proc, q=lines: [q.put(ln.strip()) for ln in p.stdout], daemon=True).start()
        holders.append(proc)
        assert lines.get(timeout=30) == "LOCKED WRITE"
    try:
        yield
    finally:
        for proc in holders:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(timeout=30)


def until(predicate: Callable[[], bool], ups: list[Up], what: str) -> None:
    """wait_for, bounded; on a timeout the `up`s are stopped and what they printed is shown."""
    try:
        wait_for(predicate, PATIENCE, what, every=0.2)
    except AssertionError:
        for up in ups:
            kill_process_group(up.proc, signal.SIGTERM)
            print(up.text[-4000:])
        raise


def per_host(ups: list[Up], cluster: Cluster, what: str) -> list[int]:
    """For each host, how many of the `up`s printed `data on HOST: WHAT`."""
    return [sum(f"data on {h.name}: {what}" in up.text for up in ups) for h in cluster.hosts]


def test_two_ups_fetching_into_one_folder_download_once(cluster: Cluster, work: Path, data: Data) -> None:
    """The first download on each host is held by the HTTP server until the other `up` says it waits for it (or,
    with no lock, until the other `up` downloads too): the two fetches overlap for certain."""
    folder = "/tmp/concurrent-fetch/data"  # each host's own /tmp: a fresh folder per host
    hosts = cluster.write_hosts_file(work / "hosts-concurrent.txt",
                                     keys={h.index: {"data_dir": folder} for h in cluster.hosts})
    with gated(data.archive.parent, cluster.gateway) as base:
        ups = [Up(start(cluster, work / f"state-c{i}", "up", "--hosts", str(hosts), "--job", f"concurrent-{i}",
                        "--gpus", "0", "--image", IMAGE, "--data-url", f"{base}/{data.archive.name}",
                        "--data-md5", data.md5, "--master-port", str(29521 + i), "--grace", "30", *SHARED_CORES, "--",
                        *TRAIN, "--epochs", "1"))
               for i in range(2)]

        def overlapped(host: Host) -> bool:
            waiting = f"data on {host.name}: another up is filling {folder}; waiting"
            return Gated.gets.count(host.addr) >= 2 or any(waiting in up.text for up in ups)

        until(lambda: all(overlapped(h) for h in cluster.hosts), ups, "both ups fetching at once")
        Gated.gate.set()
        assert [up.wait(600) for up in ups] == [0, 0]
    assert all("finished: epochs=1" in up.text for up in ups)
    assert sorted(Gated.gets) == sorted(h.addr for h in cluster.hosts)  # one download per host, not per up
    assert per_host(ups, cluster, "downloaded ") == [1, 1]
    assert per_host(ups, cluster, "verified copy present, nothing moved") == [1, 1]
    for host in cluster.hosts:
        assert host.run(["cat", f"{folder}/.ddp-cifar-verified"]).stdout.strip() == data.md5
        assert sorted(host.run(["ls", "-A", folder]).stdout.split()) == [
            ".ddp-cifar-verified", ".ddp-cifar.lock", "cifar-10-batches-py", "cifar-10-python.tar.gz"]


def test_two_ups_staging_one_folder_send_it_once(cluster: Cluster, work: Path) -> None:
    folder = "/tmp/concurrent-stage/data"
    src = work / "stage-src"
    src.mkdir()
    (src / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    (src / "extra.bin").write_bytes(bytes(range(256)) * 1200)
    hosts = cluster.write_hosts_file(work / "hosts-stage.txt",
                                     keys={h.index: {"data_dir": folder} for h in cluster.hosts})
    image = example_image("charlm")
    with held(cluster, folder):
        ups = [Up(start(cluster, work / f"state-s{i}", "up", "--hosts", str(hosts), "--job", f"staged-{i}",
                        "--gpus", "0", "--image", image, "--entry", "-m charlm.train", "--data-from", str(src),
                        "--master-port", str(29531 + i), "--grace", "30", "--", "--steps", "3", "--step-seconds",
                        "0", "--ckpt-every", "1000", "--text", "input.txt", "--context", "4"))
               for i in range(2)]
        # The test's lock makes both wait; with no lock in the code they would not, and both would send.
        waiting = [f"data on {h.name}: another up is filling {folder}; waiting" for h in cluster.hosts]
        until(lambda: all(up.proc.poll() is not None or all(w in up.text for w in waiting) for up in ups), ups,
              "both ups waiting for the test's lock")
    assert [up.wait(600) for up in ups] == [0, 0]
    assert all(w in up.text for w in waiting for up in ups)
    assert all("DONE step=3" in up.text for up in ups)
    assert per_host(ups, cluster, f"2 of 2 files changed, {1680 + 307_200} bytes sent") == [1, 1]
    assert per_host(ups, cluster, "up to date, nothing moved (2 files)") == [1, 1]
    for host in cluster.hosts:
        assert host.path(f"{folder}/extra.bin").read_bytes() == (src / "extra.bin").read_bytes()
