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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import docker.errors
import requests.exceptions

from devcluster import Cluster
from kit.fetching import serving
from kit.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")  # the Makefile passes its CPU_IMAGE
# How long a test waits for a job to reach a point (running, a checkpoint, a restart, the end of a short run): a safety
# net for a 2-core machine loaded by two xdist workers and other work (runs took 3-4x their idle time there), never a
# speed goal.
PATIENCE = 600
# pytest's timeout (900 s, pyproject.toml) ends a test with a stack trace that does not say what it waited for: every
# wait of this kit (wait_for, orchestrate, bounded) ends first, with its own message, at most TEST_BUDGET_S after its
# test began (the cluster conftest starts the clock at each test's setup); the rest is for the teardown, which ends
# what the test left running.
TEST_BUDGET_S = 840
_test_began = [time.monotonic()]


def start_test_clock() -> None:
    _test_began[0] = time.monotonic()


def bounded(timeout: float) -> float:
    """`timeout`, cut to what is left of the test's budget (at least 1 s, so that the wait still ends in its own
    message)."""
    return max(1.0, min(timeout, _test_began[0] + TEST_BUDGET_S - time.monotonic()))
# Tiny and quick: 256 training images, the "tiny" CNN, a checkpoint every epoch.
TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--log-every", "4"]
# The test hosts share this machine's cores (2 in CI, 3 test workers, 2-3 hosts each): one intra-op thread per rank,
# as torchrun gives each process when a node runs several. With torch's default of one per core, a tiny model's
# OpenMP threads spin against each other's hosts: 10.0 -> 17.3 CPU-seconds for the same 8 epochs, same wall time.
SHARED_CORES = ("--env", "OMP_NUM_THREADS=1")


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
    with serving(partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp)), bind) as base:
        yield Data(archive, md5, f"{base}/{archive.name}")


# One layer cache for every test's `up`, as on a user's machine, where it outlives any job (HOME is the cluster's).
LAYER_CACHE_HOME = REPO / "out" / "test-cache"


def orch_env(cluster: Cluster, state: Path) -> dict[str, str]:
    return {**cluster.client_env(), "XDG_STATE_HOME": str(state), "PYTHONPATH": str(REPO),
            "XDG_CACHE_HOME": str(LAYER_CACHE_HOME)}


# Every orchestrator process a test starts, so that what a failed or timed-out test left running can be ended
# (end_leftovers): a leftover `up` keeps its job, and the next `up` on those hosts is refused (port in use).
_started: list[subprocess.Popen[str]] = []


def spawn(args: list[str], env: dict[str, str], *, merge_stderr: bool) -> subprocess.Popen[str]:
    """Start `python -m orchestrate ARGS` in its own process group (so it can be ended with all it started), through
    kit/gated_orchestrate.py: the same CLI, with the gates a test may set in `env`."""
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", str(REPO))])}
    proc = subprocess.Popen([sys.executable, "-m", "kit.gated_orchestrate", *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    _started.append(proc)
    return proc


def run_to_end(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """As subprocess.run, but a run past `timeout` is ended with its whole process group, not only its first
    process, before TimeoutExpired is raised."""
    proc = spawn(args, env, merge_stderr=False)
    try:
        out, err = proc.communicate(timeout=bounded(timeout))
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
            for c in client.containers.list(all=True, filters={"label": "ddp-cifar.job"}, ignore_removed=True):
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


def up_args(hosts: Path, data: Data, job: str, *extra: str, trainer: tuple[str, ...] = (),
            image: str = IMAGE, one_thread: bool = True) -> list[str]:
    """`one_thread=False`: torch's own thread count (and, with 2 processes per node, torchrun's warning that it sets
    OMP_NUM_THREADS, a line from every node)."""
    return ["up", "--hosts", str(hosts), "--job", job, "--gpus", "0", "--image", image, "--data-url", data.url,
            "--data-md5", data.md5, "--grace", "30", *(SHARED_CORES if one_thread else ()), *extra, "--", *TRAIN,
            *trainer]


def job_containers(cluster: Cluster, job: str) -> list[tuple[str, object]]:
    """(host name, container) of the job on every host, seen through each host's local socket."""
    found = []
    for host in cluster.hosts:
        client = host.docker_client()
        try:
            # ignore_removed: docker-py reads each listed container again, and `up` removing a leftover in between
            # failed the listing with a 404 (seen: a test looking for a rank while `up` started)
            found += [(host.name, c) for c in client.containers.list(all=True, filters={"label": f"ddp-cifar.job={job}"},
                                                                     ignore_removed=True)]
        finally:
            client.close()
    return found


def node_container(cluster: Cluster, job: str, node: int):  # type: ignore[no-untyped-def]
    """The job's one container of node `node` (by its node-rank label), on whichever host holds it."""
    found = [c for _, c in job_containers(cluster, job) if c.labels.get("ddp-cifar.node-rank") == str(node)]
    assert len(found) == 1, found
    return found[0]


def throttle_job(cluster: Cluster, job: str, cpus: float = 0.1) -> int:
    """Each running container of the job limited to `cpus` of a core (docker update), for a test whose job only
    has to keep training while it waits for something else (a scheduler's timer, another job's story): the CPU it
    would burn meanwhile is the other tests' on a shared CI machine. How many were limited. A tenth of a core: a
    tiny step (batch 16, one thread) takes under 10 ms of CPU, so an agreement (8 steps) still comes within a
    second and a stop within its grace; at a quarter the Slurm time-limit test's two containers alone took 46
    CPU-seconds of a CI run while they waited for Slurm's signal."""
    limited = 0
    for host in cluster.hosts:
        client = host.docker_client()
        try:
            for container in client.containers.list(filters={"label": f"ddp-cifar.job={job}"}):
                container.update(cpu_period=100_000, cpu_quota=int(cpus * 100_000))
                limited += 1
        finally:
            client.close()
    return limited


def manifests(folder: Path) -> list[dict[str, object]]:
    """The checkpoint manifests in a folder: ckpt-<step>.json (DDP) and ckpt-<step>/manifest.json (FSDP)."""
    out = []
    for path in sorted([*folder.glob("ckpt-*.json"), *folder.glob("ckpt-*/manifest.json")]):
        try:
            out.append(json.loads(path.read_text()) | {"_mtime": path.stat().st_mtime})
        except (OSError, ValueError):
            continue
    return out


def wait_for(predicate: Callable[[], object], timeout: float, what: str, every: float = 1.0) -> None:
    """wait_until, within what is left of the test's budget."""
    wait_until(predicate, bounded(timeout), what, every)


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


class Up:
    """An attached `up` in the background; its output collected line by line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines, self.seen_at = proc, [], []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.seen_at.append(time.monotonic())

    def first(self, text: str, after: float = 0.0) -> float:
        """When the first line holding `text` (seen after `after`) arrived."""
        return next(t for t, line in zip(self.seen_at, self.lines, strict=False) if t >= after and text in line)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float, what: str) -> None:
        """Until a line holds `text`; on timeout the failure shows what `up` printed (the why of a flaky run)."""
        try:
            wait_for(lambda: text in self.text, timeout, what, every=0.2)
        except AssertionError as err:
            raise AssertionError(f"{err}; up printed:\n{self.text[-6000:]}") from None

    def wait(self, timeout: float) -> int:
        timeout = bounded(timeout)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"up still running after {timeout} s:\n{self.text[-5000:]}") from None
        self.thread.join(timeout=10)
        print(self.timeline())
        return rc

    def timeline(self) -> str:
        """What `up` printed, each line after the seconds since its first: where a slow run spent its time."""
        start = self.seen_at[0] if self.seen_at else 0.0
        return "\n".join(f"{t - start:7.1f} {line}" for t, line in zip(self.seen_at, self.lines, strict=False))


def metrics(cluster: Cluster, node: int, job: str) -> list[dict]:
    """The epoch records and resume/restart events (not the step records of every --log-every steps)."""
    rows = [json.loads(ln) for ln in (job_dir(cluster, node, job) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") != "train_step"]


def epochs_of(records: list[dict]) -> list[int]:
    return [r["epoch"] for r in records if "event" not in r and not r.get("partial")]


def example_image(name: str) -> str:
    """Build examples/<name> FROM the test image (cached after the first build); its tag follows IMAGE's."""
    tag = f"ddp-example-{name}:{IMAGE.rpartition(':')[2] or 'latest'}"
    subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE={IMAGE}", "-f", f"examples/{name}/Dockerfile",
                    "-t", tag, "examples"], cwd=REPO, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return tag


def crash_image() -> str:
    """The test image with tests/programs/crash_at_step planted (built FROM IMAGE, cached after the first build): with
    `--env CRASH_AT_STEP=N`, the trainer's global rank 0 raises right after step N, as a bug would."""
    tag = f"ddp-crash-at-step:{IMAGE.rpartition(':')[2] or 'latest'}"
    subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE={IMAGE}", "-t", tag, "tests/programs/crash_at_step"],
                   cwd=REPO, check=True, timeout=600, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return tag


def up(cluster: Cluster, work: Path, hosts: Path, job: str, image: str, entry: str, *extra: str,
       args: list[str]) -> subprocess.CompletedProcess[str]:
    return orchestrate(cluster, work / "state", "up", "--hosts", str(hosts), "--job", job, "--gpus", "0",
                       "--image", image, "--entry", entry, "--grace", "30", *extra, "--", *args)


# The default dirs (the hosts file names none): under the login's home, which each test host has of its own.
DATA = "/home/ddp/.cache/ddp-cifar/data"
