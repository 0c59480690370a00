"""The watcher's decisions, with fake daemons: which node failed, when a host counts as unreachable."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from kit.units import job_specs
from rich.console import Console

from orchestrate.backends.docker_ssh import start
from orchestrate.backends.docker_ssh.ranks import ContainerRanks
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import SSHError
from orchestrate.hosts import Host
from orchestrate.outcome import End
from orchestrate.plan.restarts import RESTARTABLE
from orchestrate.probe.observations import NodeFacts
from orchestrate.watch import progress
from orchestrate.watch import watcher as watching

GONE: dict[str, Any] = {"gone": True}  # the daemon answers, but the container was removed


class FakeAPI:
    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def wait(self, _id: str) -> dict[str, Any]:
        assert self.state is not None and self.state["Status"] == "exited"
        return {"StatusCode": self.state["ExitCode"]}

    def inspect_container(self, _id: str) -> dict[str, Any]:
        if self.state is None:
            raise TimeoutError("no answer")
        if self.state is GONE:
            raise docker.errors.NotFound("No such container")
        return {"State": self.state}


class FakeConn:
    """SSH to a host: node 0's heartbeat file as `read_beat` reads it, and the boot script's output, or no
    answer (None)."""

    def __init__(self) -> None:
        self.heartbeat: bytes | None = None
        self.boot: str | None = None

    def read_file(self, _path: str, timeout: float) -> bytes:
        if self.heartbeat is None:
            raise FileNotFoundError(_path)
        return self.heartbeat

    def run(self, argv: list[str], timeout: float = 60) -> Any:
        if self.boot is None:
            raise TimeoutError("no answer")
        return type("Result", (), {"rc": 0, "out": self.boot, "err": ""})()


class FakeNodes:
    def __init__(self, states: list[dict[str, Any] | None], api: type[FakeAPI] = FakeAPI) -> None:
        self.states, self.api = states, api
        self.conns = [FakeConn() for _ in states]
        self.node0 = self.conns[0]
        self.boots: list[str | None] = [None] * len(states)  # no SSH answer unless a test sets one
        self.lost: dict[int, str] = {}

    def lose(self, rank: int, why: str) -> None:
        self.lost[rank] = why

    def docker(self, rank: int, timeout: float | None = 60) -> Any:
        return type("Client", (), {"api": self.api(self.states[rank])})()

    def conn(self, rank: int) -> FakeConn:
        if rank in self.lost:  # as Session.conn does for a lost node
            raise SSHError(f"h{rank} unreachable: {self.lost[rank]}")
        self.conns[rank].boot = self.boots[rank]
        return self.conns[rank]


def watcher(states: list[dict[str, Any] | None], api: type[FakeAPI] | None = None,
            memory: str | None = None) -> watching.Watcher:
    hosts = [Host(name=f"h{i}", hostname=f"h{i}", port=22, user=None) for i in range(len(states))]
    config = UpConfig.of(ssh=SSHOptions(Path("x"), None, False), gpus=0, memory=memory)
    specs = job_specs(config, hosts, "h0", [NodeFacts("eth0")] * len(hosts))
    containers = [type("C", (), {"id": f"c{i}"})() for i in range(len(hosts))]
    nodes = FakeNodes(states, api or FakeAPI)
    return watching.Watcher(specs, ContainerRanks(nodes, containers), Console(), [])  # type: ignore[arg-type]


RUNNING = {"Status": "running", "ExitCode": 0}


def exited(code: int, at: str) -> dict[str, Any]:
    return {"Status": "exited", "ExitCode": code, "FinishedAt": at}


def test_running_then_success() -> None:
    assert watcher([RUNNING, RUNNING]).poll() is None
    assert watcher([exited(0, "t"), RUNNING]).poll() is None
    outcome = watcher([exited(0, "t"), exited(0, "t")]).poll()
    assert outcome is not None and outcome.ok


def test_a_node_still_running_long_after_the_others_ended_well_is_a_stall() -> None:
    """A rank that hangs in its teardown (after its peers exited 0) would keep `up` attached for ever."""
    w = watcher([exited(0, "2026-01-01T00:00:05Z"), RUNNING])
    w.stall.timeout_s, w.stall.seen, w.stall.last_change = 30.0, True, 0.0  # the last beat ("done"), long ago
    outcome = w.poll()
    assert outcome is not None and (outcome.ok, outcome.end) == (False, End.STALLED)
    assert outcome.reason.startswith("1 node(s) still running ") and "though 1 ended with exit 0" in outcome.reason
    w.stall.last_change = 1e18  # within the limit: the others get their time to end
    assert w.poll() is None


def test_the_previous_runs_last_heartbeat_is_never_shown_as_this_attempts_progress() -> None:
    """`up --resume` (or a second `up`) of a job finds the last run's `done` beat in the checkpoint folder: it was
    written before this attempt's container started (both times by node 0's clock, whatever the clock here says),
    so no progress line shows until the new run beats."""
    started = "2001-01-01T00:00:10.5Z"  # node 0's container start, as Docker reports it
    w = watcher([{**RUNNING, "StartedAt": started}, RUNNING])
    out = io.StringIO()
    view = progress.ProgressView(Console(file=out, width=200))
    old = {"step": 4, "total_steps": 4, "epoch": 2, "epochs": 2, "state": "done", "slowest_step_s": 0.1}
    w.ranks.nodes.node0.heartbeat = json.dumps({**old, "time": 978307205.0}).encode()  # type: ignore[attr-defined]
    for _ in range(2):  # the first round learns the start; the second knows the beat is older than it
        assert w.poll() is None
        view.show(w.beat)
    assert w.beat is None and out.getvalue() == ""
    new = {**old, "step": 1, "total_steps": 8, "state": "training", "time": 978307211.0}
    w.ranks.nodes.node0.heartbeat = json.dumps(new).encode()  # type: ignore[attr-defined]
    assert w.poll() is None
    view.show(w.beat)
    assert w.beat is not None and w.beat.step == 1 and out.getvalue().startswith("progress: step 1/8 (12%)")


@pytest.mark.parametrize("first", [0, 1])
def test_names_the_node_seen_failing_first_whatever_the_hosts_clocks(first: int) -> None:
    """One node fails first, the other loses its peer and fails 2 s later. Node 1's host clock is 60 s behind node
    0's, so its FinishedAt is the earlier one either way: the node named is the one whose exit this machine saw
    first (its wait returned first), never the one with the smaller FinishedAt."""
    finished = ["2026-01-01T00:01:00Z", "2026-01-01T00:00:02.123456789Z"]  # node 1's clock 60 s behind
    w = watcher([exited(1, finished[0]), exited(137, finished[1])])
    for rank in (first, 1 - first):  # the order in which the daemons' waits returned
        w._wait(rank)
    outcome = w.poll()
    assert outcome is not None and not outcome.ok
    assert (outcome.failed_rank, outcome.reason) == (first, f"exited with code {(1, 137)[first]}")


def test_an_oom_kill_names_the_limit_and_what_to_do() -> None:
    states = [RUNNING, {**exited(137, "2026-01-01T00:00:02Z"), "OOMKilled": True}]
    outcome = watcher(states).poll()
    assert outcome is not None and outcome.failed_rank == 1
    assert outcome.reason == ("killed by the kernel's OOM killer: out of the host's memory (no --memory limit); "
                              "lower --batch-size, or give it more memory with --memory (/dev/shm counts too: "
                              "--shm-size)")
    outcome = watcher(states, memory="512m").poll()
    assert outcome is not None and "out of its memory limit (--memory 512m);" in outcome.reason


def test_unreachable_only_after_the_grace_window(monkeypatch: pytest.MonkeyPatch) -> None:
    w = watcher([RUNNING, None])
    assert w.poll() is None  # one missed poll is not a dead host
    w.last_seen[1] -= watching.UNREACHABLE_S + 1
    outcome = w.poll()
    assert outcome is not None and (outcome.failed_rank, outcome.ok) == (1, False)
    assert "unreachable" in outcome.reason
    # Lost for the rest of the attempt: the stop and the checkpoint search that follow do not wait on it again.
    assert w.ranks.nodes.lost == {1: "it answered nothing for 16 s"}  # type: ignore[attr-defined]
    results: list[dict[str, Any] | None] = [None, None]
    w._poll_one(1, results)  # a poll still under way then: no answer, not an exception in its thread
    assert results == [None, None]


BOOT = "b-1\n4242 1000\n"  # boot id; dockerd's pid and start time


@pytest.mark.parametrize(("now", "cause"), [("b-1\n5151 2000\n", "Docker daemon on h1 restarted"),
                                            ("b-2\n4242 1000\n", "h1 rebooted")])
def test_a_restarted_daemon_or_a_rebooted_host_is_named_at_once_not_unreachable(now: str, cause: str) -> None:
    w = watcher([RUNNING, None])
    w.ranks.nodes.boots = [BOOT, BOOT]  # type: ignore[attr-defined]
    w.read_boots()
    w.ranks.nodes.boots[1] = now  # type: ignore[attr-defined]
    outcome = w.poll()  # the first poll whose API call fails: the host answers over SSH and tells why
    assert outcome is not None and (outcome.end, outcome.failed_rank, outcome.reason) == (End.HOST, 1, cause)
    assert outcome.end in RESTARTABLE


def test_a_quick_restart_answering_the_next_poll_is_still_the_restart_not_an_exit_code() -> None:
    """The daemon was back before the poll: it answers that the container exited (the restart stopped it), and
    the peer on node 0 exited too, having lost node 1. The cause is node 1's restart, named at once."""
    w = watcher([exited(1, "2026-01-01T00:00:05Z"), exited(143, "2026-01-01T00:00:06Z")])
    w.ranks.nodes.boots = [BOOT, BOOT]  # type: ignore[attr-defined]
    w.read_boots()
    w.ranks.nodes.boots[1] = "b-1\n5151 2000\n"  # type: ignore[attr-defined]
    outcome = w.poll()
    assert outcome is not None and (outcome.end, outcome.failed_rank) == (End.HOST, 1)
    assert outcome.reason == "Docker daemon on h1 restarted"


@pytest.mark.parametrize("ssh", [BOOT, None])  # node 1's daemon is shutting down (same pid) / its host reboots
def test_a_peer_that_exits_while_a_node_does_not_answer_is_not_blamed(ssh: str | None) -> None:
    w = watcher([exited(1, "2026-01-01T00:00:05Z"), None])
    w.ranks.nodes.boots = [BOOT, BOOT]  # type: ignore[attr-defined]
    w.read_boots()
    w.ranks.nodes.boots[1] = ssh  # type: ignore[attr-defined]
    assert w.poll() is None  # wait for node 1 to tell (at most UNREACHABLE_S): node 0 lost its peer
    w.last_seen[1] -= watching.UNREACHABLE_S + 1
    outcome = w.poll()
    assert outcome is not None and outcome.failed_rank == 1 and outcome.end is not End.EXITED


def test_a_reboot_seen_only_after_the_peers_exit_is_still_the_cause_once_its_sshd_answers_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reboot stops node 1's dockerd, whose shutdown still answers "running" while node 0 exits having lost its
    peer: node 0 is named first. Once the job is stopped node 1's sshd is down too (a reboot starts it after
    dockerd): the host gets time to answer, and its new boot id, not node 0's exit code, is the cause (CI saw
    "node 0 exited with code 1" when no SSH answer was taken for "nothing happened")."""
    w = watcher([exited(1, "2026-01-01T00:00:05Z"), RUNNING])
    w.ranks.nodes.boots = [BOOT, BOOT]  # type: ignore[attr-defined]
    w.read_boots()
    outcome = w.poll()
    assert outcome is not None and (outcome.end, outcome.failed_rank) == (End.EXITED, 0)
    w.ranks.nodes.boots[1] = None  # type: ignore[attr-defined]  # rebooting: sshd does not answer
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the host comes back after two polls
        waits.append(seconds)
        if len(waits) == 2:
            w.ranks.nodes.boots[1] = "b-2\n5151 2000\n"  # type: ignore[attr-defined]

    monkeypatch.setattr(watching.time, "sleep", sleep)
    outcome = watching.blame_a_host_change(w, outcome)
    assert (outcome.end, outcome.failed_rank, outcome.reason) == (End.HOST, 1, "h1 rebooted")


def test_a_daemon_down_while_sshd_answers_fails_the_node_after_the_grace_window_with_that_cause() -> None:
    w = watcher([RUNNING, None])
    w.ranks.nodes.boots = [BOOT, BOOT]  # type: ignore[attr-defined]
    w.read_boots()
    w.ranks.nodes.boots[1] = "b-1\n"  # sshd answers, no dockerd runs: it may be restarting, so no verdict yet
    assert w.poll() is None
    w.last_seen[1] -= watching.UNREACHABLE_S + 1
    outcome = w.poll()
    assert outcome is not None and outcome.end is End.HOST
    assert outcome.reason == f"Docker daemon on h1 is down (sshd answers) for {watching.UNREACHABLE_S:.0f} s"


def test_a_removed_container_is_not_an_unreachable_host() -> None:
    # `kill` from another terminal removes the containers: the host answers, so say so at once.
    outcome = watcher([RUNNING, GONE]).poll()
    assert outcome is not None and (outcome.failed_rank, outcome.ok) == (1, False)
    assert "removed" in outcome.reason and "unreachable" not in outcome.reason


class FakeContainer:
    def __init__(self) -> None:
        self.removed = False

    def start(self) -> None:
        pass

    def remove(self, force: bool = False) -> None:
        self.removed = True


class CreatingNodes:
    """Node 0 creates its container at once; node 1's daemon refuses (a missing image, a bad mount...)."""

    def __init__(self) -> None:
        self.made: list[FakeContainer] = []

    def docker(self, rank: int, timeout: float | None = 60) -> Any:
        def create(**_: Any) -> FakeContainer:
            if rank == 1:
                raise docker.errors.APIError("invalid mount config")
            self.made.append(FakeContainer())
            return self.made[-1]
        return type("Client", (), {"containers": type("Containers", (), {"create": staticmethod(create)})()})()


def test_a_create_failing_on_one_node_removes_the_containers_created_on_the_others() -> None:
    hosts = [Host(name=f"h{i}", hostname=f"h{i}", port=22, user=None) for i in range(2)]
    specs = job_specs(UpConfig.of(ssh=SSHOptions(Path("x"), None, False), gpus=0), hosts, "h0", [NodeFacts("eth0")] * 2)
    nodes = CreatingNodes()
    with pytest.raises(Exception, match="h1"):
        start.start_containers(nodes, specs)  # type: ignore[arg-type]
    assert len(nodes.made) == 1 and nodes.made[0].removed


class EndedAPI(FakeAPI):
    """A container that printed one line and exited: its log stream ends, its wait returns."""

    def logs(self, _id: str, **_kwargs: Any) -> Any:
        return iter([b"2026-11-23T10:00:00.000000001Z DONE\n"])

    def wait(self, _id: str) -> dict[str, Any]:
        return {"StatusCode": 0}


def test_a_log_stream_ends_with_its_container_without_waiting_to_follow_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry delay is for a stream broken while its container runs; an exited container's stream ends at
    once (it cost every `up` a second at the end, before its summary)."""
    monkeypatch.setattr(watching, "STREAM_RETRY_S", 60.0)
    w = watcher([{"Running": False}, {"Running": False}], EndedAPI)
    w.start_streams()
    w.drain_streams(10.0)
    assert not [t for t in w.streams if t.is_alive()]
