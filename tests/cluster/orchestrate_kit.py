"""Helpers for the orchestrator's tests on real test hosts (tests/cluster/test_orchestrate_*.py).

The orchestrator runs as a subprocess (`python -m orchestrate`), exactly as a user runs it, with
HOME=cluster.home (the cluster's ssh config and known_hosts) and a private XDG_STATE_HOME. The hosts log
in as a non-root user and have their own /home, /tmp, /var/tmp: look at a host's files (checkpoints,
data, logs) through cluster.hosts[i].path("/path/as/the/host/sees/it"), and assert ownership with
cluster.hosts[i].foreign_files(dir) == [].
Training uses tiny synthetic data (served over HTTP from the machine's bridge address) and a tiny model.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import docker.errors
import requests.exceptions

from devcluster import Cluster

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")  # the Makefile passes its CPU_IMAGE
# How long a test waits for a job to reach a point (running, a checkpoint, a restart, the end of a short run): a safety
# net for a 2-core machine loaded by two xdist workers and other work (runs took 3-4x their idle time there), never a
# speed goal. pytest's timeout (900 s, pyproject.toml) still bounds each test as a whole.
PATIENCE = 600
# Tiny and quick: 256 training images, the "tiny" CNN, a checkpoint every epoch.
TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--log-every", "4"]


@dataclass(frozen=True)
class Data:
    archive: Path
    md5: str
    url: str


@contextmanager
def serve_data(tmp: Path, bind: str) -> Iterator[Data]:
    """Write a synthetic CIFAR archive and serve it over HTTP on `bind` (the bridge address)."""
    archive = tmp / "cifar-synth.tar.gz"
    subprocess.run([sys.executable, "-m", "trainer.data", "synth", "--out", str(tmp / "synth"), "--train", "256",
                    "--test", "128", "--archive", str(archive)], check=True, cwd=REPO, timeout=120,
                   capture_output=True)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp))
    server = http.server.ThreadingHTTPServer((bind, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Data(archive, md5, f"http://{bind}:{server.server_address[1]}/{archive.name}")
    finally:
        server.shutdown()
        server.server_close()


# One layer cache for every test's `up`, as on a user's machine, where it outlives any job (HOME is the cluster's).
LAYER_CACHE_HOME = REPO / "out" / "test-cache"


def orch_env(cluster: Cluster, state: Path) -> dict[str, str]:
    return {**cluster.client_env(), "XDG_STATE_HOME": str(state), "PYTHONPATH": str(REPO),
            "XDG_CACHE_HOME": str(LAYER_CACHE_HOME)}


# Every orchestrator process a test starts, so that what a failed or timed-out test left running can be ended
# (end_leftovers): a leftover `up` keeps its job, and the next `up` on those hosts is refused (port in use).
_started: list[subprocess.Popen[str]] = []


def spawn(args: list[str], env: dict[str, str], *, merge_stderr: bool) -> subprocess.Popen[str]:
    """Start `python -m orchestrate ARGS` in its own process group (so it can be ended with all it started)."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrate", *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    _started.append(proc)
    return proc


def run_to_end(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """As subprocess.run, but a run past `timeout` is ended with its whole process group, not only its first
    process, before TimeoutExpired is raised."""
    proc = spawn(args, env, merge_stderr=False)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def end_leftovers() -> list[str]:
    """SIGKILL the process group of every orchestrator process started so far that still runs; returns their
    command lines."""
    ended = []
    for proc in _started:
        if proc.poll() is None:
            kill_process_group(proc, signal.SIGKILL)
            proc.wait(timeout=30)
            ended.append("orchestrate " + " ".join(proc.args[3:]))
    _started.clear()
    return ended


def remove_job_containers(cluster: Cluster) -> list[str]:
    """Force-remove every job container (any job) on the cluster's hosts, through each host's local socket; returns
    "host: container" of those removed. A host whose dockerd is down (a test stopped it) has none running."""
    removed = []
    for host in cluster.hosts:
        client = host.docker_client(timeout=30)
        try:
            for c in client.containers.list(all=True, filters={"label": "ddp-cifar.job"}):
                c.remove(force=True)
                removed.append(f"{host.name}: {c.name}")
        except (docker.errors.DockerException, requests.exceptions.ConnectionError):
            continue
        finally:
            client.close()
    return removed


def orchestrate(cluster: Cluster, state: Path, *args: str, timeout: float = PATIENCE) -> subprocess.CompletedProcess[str]:
    """Run `python -m orchestrate ARGS`; output is kept (and printed when a test fails)."""
    res = run_to_end(list(args), orch_env(cluster, state), timeout)
    print(f"$ orchestrate {' '.join(args)}\n--- rc={res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def start(cluster: Cluster, state: Path, *args: str) -> subprocess.Popen[str]:
    """Start `python -m orchestrate ARGS` in the background (its own process group; stderr into stdout)."""
    return spawn(list(args), orch_env(cluster, state), merge_stderr=True)


def up_args(hosts: Path, data: Data, job: str, *extra: str, trainer: tuple[str, ...] = ()) -> list[str]:
    return ["up", "--hosts", str(hosts), "--job", job, "--gpus", "0", "--image", IMAGE, "--data-url", data.url,
            "--data-md5", data.md5, "--grace", "30", *extra, "--", *TRAIN, *trainer]


def job_containers(cluster: Cluster, job: str) -> list[tuple[str, object]]:
    """(host name, container) of the job on every host, seen through each host's local socket."""
    found = []
    for host in cluster.hosts:
        client = host.docker_client()
        try:
            found += [(host.name, c) for c in client.containers.list(all=True, filters={"label": f"ddp-cifar.job={job}"})]
        finally:
            client.close()
    return found


def manifests(folder: Path) -> list[dict[str, object]]:
    """The checkpoint manifests in a folder: ckpt-<step>.json (DDP) and ckpt-<step>/manifest.json (FSDP)."""
    out = []
    for path in sorted([*folder.glob("ckpt-*.json"), *folder.glob("ckpt-*/manifest.json")]):
        try:
            out.append(json.loads(path.read_text()) | {"_mtime": path.stat().st_mtime})
        except (OSError, ValueError):
            continue
    return out


def wait_for(predicate, timeout: float, what: str, every: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def default_dirs(cluster: Cluster, node: int, job: str) -> dict[str, str]:
    """The job's default data/checkpoint/log dirs on a host, as the HOST sees them (under the login's home)."""
    home = cluster.hosts[node].home
    return {"data": f"{home}/.cache/ddp-cifar/data", "ckpt": f"{home}/.local/share/ddp-cifar/jobs/{job}/checkpoints",
            "log": f"{home}/.local/share/ddp-cifar/jobs/{job}/logs"}


def job_dir(cluster: Cluster, node: int, job: str, kind: str = "checkpoints") -> Path:
    """A job's default checkpoint (or log: kind "logs") dir on a host, as seen from this machine."""
    return cluster.hosts[node].path(default_dirs(cluster, node, job)["log" if kind == "logs" else "ckpt"])


def data_dir(cluster: Cluster, node: int) -> Path:
    """The default data dir on a host, as seen from this machine."""
    return cluster.hosts[node].path(default_dirs(cluster, node, "-")["data"])


def sigterm_step(cluster: Cluster, node: int, job: str) -> int | None:
    """The step of the trainer's "stopped by SIGTERM at step N" line in the node's per-rank log files."""
    for log in sorted(job_dir(cluster, node, job, "logs").rglob("*.log")):
        found = re.search(r"stopped by SIGTERM at step (\d+)", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
    return None


def host_dirs(base: Path, n: int) -> dict[int, dict[str, str]]:
    """Explicit data/checkpoint/log dirs per host, for a test about explicit dirs. The hosts need none:
    each has its own /home, /tmp, /var/tmp, so the defaults are per host. These are paths as the HOSTS
    see them (base under /tmp is each host's own /tmp): read them with cluster.hosts[i].path(p)."""
    return {i: {"data_dir": str(base / f"n{i}" / "data"), "ckpt_dir": str(base / f"n{i}" / "ckpt" / "{job}"),
                "log_dir": str(base / f"n{i}" / "logs" / "{job}")} for i in range(n)}


def kill_process_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
