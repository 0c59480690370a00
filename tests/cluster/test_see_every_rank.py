"""See every rank (issue 35), on the session's three stock test hosts (sshd + dockerd + torchrun, CPU image):

- one host's container throttled (`docker update --cpus 0.02 --cpu-shares 2` on that host's daemon) while the
  job runs: from a grace of the rule's windows after the throttle on (the window holding the step of node 0's
  first heartbeat written after it, STRAGGLER_WINDOWS windows more, and one for the figures' trip in the
  next window's agreement), every `status` and every progress line
  names that node and no other (with its work several times the others', no other node can be 1.3x the median); an empty reading fails
  as a wrong one does, and two statuses past the grace are required. The progress line names it within a bounded
  time. Once the throttle is lifted, nothing is named. The throttle starts from a beat in which no node is clearly
  slower (every streak at zero). What this test does not assert: that a healthy job names nobody. Three nodes on
  2 shared cores beside the other xdist worker are not healthy in that sense: a rank sharing a core is clearly
  slower for seconds, and the rule names it (seen in CI: node 0 at 1.7x then 3.6x in a job's first windows, named
  just after the throttle; here once, node 1 at 1.4x). That one slow window names nobody is a unit test
  (tests/trainer/test_trainer_ranks.py);
- `status` shows one line per node;
- `tensorboard --job` fetches node 0's event files, TensorBoard serves them on a local port and answers a request
  for the scalars, and the command ends when signalled;
- once the job has ended (`up` gone, then its containers stopped and left in place), `status` labels its last
  progress line as the last run's, with when it ended.

One job does all of it (a tiny model, CPU): a cluster test costs a job's start.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.orchestrate_kit import Data, Up, job_dir, orch_env, orchestrate, spawn, start, up_args, wait_for

from devcluster import Cluster
from trainer.contract import HEARTBEAT_FILE, Beat
from trainer.pace import AGREE_EVERY
from trainer.straggler import STRAGGLER_WINDOWS, clearly_slower

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.slow]

JOB = "ranks"
THROTTLED = 2  # the node whose container gets a small CPU share
NAME_WITHIN_S = 300.0  # the bound on naming it (steps of several seconds throttled) and on naming nobody once lifted
STATUS_EVERY_S = 5.0  # `status` is a process with 3 SSH connections: asked more often, it slows the job it watches
STEP = re.compile(r"progress: step (\d+)")
SLOWEST = re.compile(r"slowest: node (\d+) rank (\d+), ([\d.]+)x the median step")
NODE_WORK = re.compile(r"^node \d+ \S+: step \S+ s, work (\S+) s", re.M)
QUIET_WITHIN_S = 180.0  # the bound on a beat with every streak at zero before the throttle


@pytest.fixture(scope="module")
def target(cluster_factory, cpu_image: str) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """The session's three hosts (as the network check and the self-healing tests use them)."""
    yield cluster_factory(3, no_sftp=[2])


def docker(cluster: Cluster, node: int, *args: str) -> str:
    """The docker CLI on that node's own daemon."""
    done = subprocess.run(["docker", "-H", cluster.hosts[node].docker_host, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def container(cluster: Cluster, node: int) -> str:
    return docker(cluster, node, "ps", "-aq", "--filter", f"label=ddp-cifar.job={JOB}")


HEALTHY_CPUS = "0.3"  # every node's container between the throttles: equal, and not the CPU the other tests need


def throttle(cluster: Cluster, node: int, on: bool) -> None:
    """The job's container on that node's own daemon throttled (`docker update`): 2% of a core and the smallest CPU
    weight, so that it stays clearly slower however loaded the machine is. Measured here: a 0.1-core quota alone
    left node 2 at 1.0x the median at a load of 20-38 (every process got about a tenth of a core), and with a
    quarter of the default weight too at 1.0-1.3x at a load of 6-14 (the others' own work varied 100x between
    windows); 5% of a core named it at 159x in every reading (steps of 4 s), but in one CI run the healthy nodes,
    starved by the other tests, took 1.04 s of work a step in one window against node 2's 1.31 s (1.26x: not
    clearly slower), which broke its streak past the grace. 2% gives it 2.5 times that work. Off: the healthy
    nodes' quota (HEALTHY_CPUS), the default weight."""
    docker(cluster, node, "update", "--cpus", "0.02" if on else HEALTHY_CPUS, "--cpu-shares", "2" if on else "1024",
           container(cluster, node))


def cap_every_node(cluster: Cluster) -> None:
    """Every node's container as a lifted throttle leaves it, HEALTHY_CPUS of a core: the job trains all out
    otherwise (2 threads a rank, each node took ~17 CPU-seconds of a CI run over the test), and equal quotas keep the
    healthy nodes equal."""
    for node in range(len(cluster.hosts)):
        throttle(cluster, node, False)


def status(cluster: Cluster, state: Path) -> str:
    res = orchestrate(cluster, state, "status", "--job", JOB)
    assert res.returncode == 0, res.stderr
    return res.stdout


def named(text: str) -> list[tuple[int, float]]:
    """(node, score) of every straggler a text names."""
    return [(int(m.group(1)), float(m.group(3))) for m in SLOWEST.finditer(text)]


def quiet(text: str) -> bool:
    """A status whose beat has every node's work and none clearly slower than the median (straggler.clearly_slower,
    one rank per node here): every streak is zero in that beat, a node named later is named by later windows."""
    works = [float(w) for w in NODE_WORK.findall(text)]
    return len(works) == 3 and not any(clearly_slower(works))


def step_of(text: str) -> int:
    """The beat's step in a progress line or `status`."""
    found = STEP.search(text)
    assert found, text
    return int(found.group(1))


def grace_end(cluster: Cluster, throttled_at: float) -> int:
    """The first step from which the rule must name the throttled node in every beat: after the window the throttle
    landed in (it holds the step of node 0's first heartbeat written after the throttle, or ends before it), the
    rule's STRAGGLER_WINDOWS windows after that, and one window more, plus one step. The window more: each rank
    sends its figures of a window in the agreement that ends the next one (trainer/ranktime.py, `send`), so the
    streak counts a window one window after it ended; the step: the beat of the agreement's step was written before
    it. A window ends every AGREE_EVERY steps and at each epoch's end (trainer/loop.py). Without the window more, a
    CI run failed with the grace at step 26 and the status of step 28 naming nobody (windows ending at 16, 20, 24,
    25, 30: node 2 named from step 30 on, as the lag says)."""
    path = job_dir(cluster, 0, JOB) / HEARTBEAT_FILE

    def written_after() -> Beat | None:
        beat = Beat.parse(path.read_text()) if path.exists() else None
        return beat if beat and beat.time and beat.time >= throttled_at else None

    wait_for(written_after, 60, "a heartbeat written after the throttle", every=0.5)
    beat = written_after()
    assert beat is not None and beat.total_steps and beat.epochs, beat
    per_epoch = beat.total_steps // beat.epochs
    ends = (step for step in itertools.count(beat.step) if step % AGREE_EVERY == 0 or step % per_epoch == 0)
    return next(itertools.islice(ends, STRAGGLER_WINDOWS + 1, None)) + 1


def progress_after(up: Up, since: float) -> list[tuple[int, list[int]]]:
    """(beat step, nodes named) of every progress line `up` printed after `since`."""
    return [(step_of(line), [node for node, _ in named(line)])
            for t, line in zip(up.seen_at, up.lines, strict=False) if t >= since and line.startswith("progress:")]


def named_after(up: Up, since: float) -> float | None:
    """Seconds after `since` at which `up`'s progress line first named a node, if it has."""
    return next((t - since for t, line in zip(up.seen_at, up.lines, strict=False)
                 if t >= since and line.startswith("progress:") and named(line)), None)


def wrong_after(grace: int, readings: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The readings (step, nodes named) from step `grace` on that name anything but the throttled node alone."""
    return [(step, nodes) for step, nodes in readings if step >= grace and nodes != [THROTTLED]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_throttled_node_is_named_then_nobody_and_tensorboard_serves_the_events(
        target: Cluster, work: Path, data: Data, hosts: Path) -> None:
    state = work / "state"
    # torch's own thread count (2 a rank), as in the runs this test's margins were set by: with one thread a rank
    # the throttled node's 5% of a core went further against the others, and one window of two CI runs named nobody.
    # Batches of 8, not 16: every node's work halves, the throttled node's against the others' stays the same
    # (both are CPU shares), and its throttled steps, which the grace counts, take half as long (the test took 348 s
    # of a CI worker at 16).
    up = Up(start(target, state, *up_args(hosts, data, JOB, trainer=("--epochs", "300", "--batch-size", "8"),
                                          one_thread=False)))
    throttled = False
    try:
        up.wait_for_line("progress: step", 600, "the job's first progress line")
        cap_every_node(target)
        wait_for(lambda: re.search(r"^node 2 \S+: step", status(target, state), re.M), 120,
                 "status's timing line for node 2 (every rank timed)", every=STATUS_EVERY_S)
        lines = status(target, state).splitlines()
        assert [ln.split(":")[0] for ln in lines if re.match(r"node \d \S+: step", ln)] == \
            [f"node {n} {target.hosts[n].name}" for n in range(3)]

        wait_for(lambda: quiet(status(target, state)), QUIET_WITHIN_S, "a beat with no node clearly slower",
                 every=STATUS_EVERY_S)
        throttle(target, THROTTLED, True)
        throttled, t0 = True, time.monotonic()
        grace = grace_end(target, time.time())
        readings: list[tuple[int, list[int]]] = []  # (beat step, nodes named) of every status from the throttle on

        def status_after_the_grace() -> bool:
            text = status(target, state)
            readings.append((step_of(text), [node for node, _ in named(text)]))
            return sum(step >= grace for step, _ in readings) >= 2

        wait_for(status_after_the_grace, NAME_WITHIN_S, f"two statuses of beats from step {grace} on",
                 every=STATUS_EVERY_S)
        print(f"throttled: the grace ends at step {grace}; statuses (step, nodes named) {readings}")
        # From the grace on, every reading names the throttled node and no other: an empty one is a failure too
        # (the first of them the rule names it in, at the latest). Before it, a healthy node's streak from before
        # the throttle may still name it; the throttled node's work being the largest, it cannot after one window.
        assert not wrong_after(grace, readings), f"statuses from step {grace} on: {readings}"
        # The progress line is printed when the node it names changes (and every 30 s): the line naming the throttled
        # node, or one from the grace on (naming whatever the product names then).
        wait_for(lambda: any(nodes == [THROTTLED] or step >= grace for step, nodes in progress_after(up, t0)),
                 NAME_WITHIN_S, "the progress line naming the throttled node", every=0.5)
        shown, took = progress_after(up, t0), named_after(up, t0)
        print(f"progress lines (step, nodes named) {shown}; the first naming one {took} s after the throttle")
        assert not wrong_after(grace, shown), f"progress lines from step {grace} on: {shown}\n{up.text}"
        assert any(nodes == [THROTTLED] for _, nodes in shown), f"{shown}\n{up.text}"

        throttle(target, THROTTLED, False)
        throttled, lifted = False, time.monotonic()
        wait_for(lambda: not named(status(target, state)), NAME_WITHIN_S, "status naming nobody after the throttle",
                 every=STATUS_EVERY_S)
        wait_for(lambda: any(t >= lifted and line.startswith("progress: step") and "slowest" not in line
                             for t, line in zip(up.seen_at, up.lines, strict=False)),
                 NAME_WITHIN_S, "a progress line naming nobody after the throttle")
        print(f"throttle lifted: nobody named after {time.monotonic() - lifted:.1f} s")

        serve_tensorboard(target, state, work / "tb")

        up.proc.send_signal(signal.SIGHUP)  # `up` lets go (as a closed terminal does); the job runs on
        assert up.wait(60) == 0
        stop_containers(target)  # then it ends, its containers left in place, as a job that finished
        ended = status(target, state)
        assert re.search(r"^last run, ended \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(0h0\dm\d\ds ago\): step \d+/\d+",
                         ended, re.M), ended
        assert "\nprogress:" not in ended and not ended.startswith("progress:")
    finally:
        if throttled:
            throttle(target, THROTTLED, False)
        orchestrate(target, state, "kill", "--job", JOB, "--grace", "30")


def serve_tensorboard(cluster: Cluster, state: Path, out: Path) -> None:
    """`tensorboard --job`: the event files fetched, TensorBoard on a local port answering for the scalars (the
    trainer's loss among them), and the command ended by SIGTERM, TensorBoard with it."""
    port = free_port()
    proc = spawn(["tensorboard", "--job", JOB, "--out", str(out), "--port", str(port)], orch_env(cluster, state),
                 merge_stderr=True)
    board = Up(proc)
    board.wait_for_line(f"TensorBoard at http://localhost:{port}/", 180, "TensorBoard serving")
    assert list(out.glob("node0/tensorboard/events.out.tfevents.*"))
    with urllib.request.urlopen(f"http://localhost:{port}/data/plugin/scalars/tags", timeout=30) as answer:
        tags = json.loads(answer.read())
    assert any("loss" in tag for run in tags.values() for tag in run), tags
    proc.send_signal(signal.SIGTERM)
    assert board.wait(60) == 0 and "TensorBoard stopped" in board.text
    with pytest.raises(OSError):  # nothing serves there any more
        urllib.request.urlopen(f"http://localhost:{port}/", timeout=5)


def stop_containers(cluster: Cluster) -> None:
    """SIGTERM to the job's containers on each host's own daemon (the trainer checkpoints and exits), the containers
    left in place as a job's that finished are."""
    for node in range(len(cluster.hosts)):
        docker(cluster, node, "stop", "-t", "30", container(cluster, node))
