"""Watch the running attempt: every node's log streamed, each container's exit and state, the stall rule, and on a
failure the job stopped everywhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from rich.console import Console

from orchestrate.backends.protocol import Ranks, RankState
from orchestrate.errors import SSHError
from orchestrate.fanout import fan_out
from orchestrate.loglines import follow_lines
from orchestrate.outcome import End, Outcome
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.probe.bootchange import Boot, Change, change
from orchestrate.probe.heartbeat import Beat, read_beat
from orchestrate.watch.health import STACK_WAIT_S, RankStack, StallClock, read_stacks
from orchestrate.watch.outcome import diverged_line, oom_reason
from orchestrate.watch.progress import ProgressView
from trainer.contract import EXIT_DIVERGED

POLL_S = 2.0
REMOVED = "removed"  # a pseudo-status: the scheduler answered that the node's part no longer exists
HOST_CHANGED = "host changed"  # a pseudo-status: the scheduler failed and the host rebooted or dockerd restarted
NO_API = "no api"  # a pseudo-status: the scheduler failed while sshd answers
UNREACHABLE_S = 15.0  # a host that answers no poll for this long counts as down
# After a job ended on an exit: how long a host that does not answer SSH (rebooting: sshd starts after dockerd) or
# whose dockerd is down gets to come back and say whether it rebooted or restarted, which then is the cause.
HOST_BACK_S = 60.0
LAST_LINES = 20
DIVERGED_TAIL = 100  # torchrun's failure summary (traceback and table) follows the trainer's line
FAILED_GRACE_S = 10.0
STREAM_DRAIN_S = 2.0  # at most this long for the log streams' last lines once the job has ended
STREAM_RETRY_S = 1.0  # a node's log stream broke while its container runs: follow it again this much later


@dataclass(frozen=True)
class HostSeen:
    """What the host itself says when the scheduler does not answer (HOST_CHANGED or NO_API), and why."""

    status: str
    cause: str


Seen = RankState | HostSeen | None  # one node in one poll; None: the host does not answer at all


class Watcher:
    """Streams every node's log with a `[node R]` prefix, learns of each node's exit from the scheduler's wait, and
    polls each node's state with a timeout (which also finds unreachable hosts), reads the heartbeat, the stack
    dumps and the hosts' boots: all through the scheduler's Ranks.
    """

    def __init__(self, specs: Sequence[ContainerSpec], ranks: Ranks, console: Console, secrets: list[str],
                 stall_timeout: float = 0.0) -> None:
        self.specs, self.ranks, self.console, self.secrets = specs, ranks, console, secrets
        self.stall = StallClock(stall_timeout)
        self.last_seen = [time.monotonic()] * len(specs)
        # When this machine learned of each container's exit (its wait returned): the order of failures across
        # hosts. Never the hosts' own FinishedAt: their clocks may differ by more than the failures lie apart.
        self.exit_seen: list[float | None] = [None] * len(specs)
        self.boots: list[Boot | None] = [None] * len(specs)  # each host's boot and dockerd as the job started
        self.stop_event = threading.Event()
        self.exited = threading.Event()  # a container exited (or its wait broke): poll now, not at the next tick
        self.streams: list[threading.Thread] = []

    def read_boots(self) -> None:
        """Each host's boot and daemon now, to tell later why its Docker API stopped answering."""
        self.boots = fan_out("boot check", list(range(len(self.specs))), self.ranks.boot,
                             lambda r: self.specs[r].host.label)

    def start_streams(self) -> None:
        for rank in range(len(self.specs)):
            self.streams.append(threading.Thread(target=self._stream, args=(rank,), daemon=True))
        for t in self.streams:
            t.start()

    def _stream(self, rank: int) -> None:
        threading.Thread(target=self._wait, args=(rank,), daemon=True).start()
        while not self.stop_event.is_set():
            try:
                follow_lines(self.console, rank, self.ranks.follow(rank), self.secrets, self.stop_event)
            except Exception:  # the stream is best effort; the poller decides what happened
                pass
            # The stream ends with the node's part (then at once: `up` waits for the last lines), or with a
            # dropped connection while it runs on: then follow again from the last line shown (the connection
            # is opened anew), until the job's end stops us.
            if not self._running(rank) or self.stop_event.wait(STREAM_RETRY_S):
                return

    def _running(self, rank: int) -> bool:
        try:
            return self.ranks.running(rank)
        except Exception:  # unreachable for now: try again while the job lasts
            return True

    def _wait(self, rank: int) -> None:
        """Block in the scheduler's wait until the node's part exits: the exit is seen at once, without polling."""
        try:
            self.ranks.wait_exit(rank)
            self.exit_seen[rank] = time.monotonic()
        except Exception:  # unreachable or removed: the poller tells which
            pass
        self.exited.set()

    def drain_streams(self, timeout: float) -> None:
        """Let the log streams print the last lines: they end with their containers (bounded wait)."""
        deadline = time.monotonic() + timeout
        for t in self.streams:
            t.join(max(0.0, deadline - time.monotonic()))

    def poll(self) -> Outcome | None:
        """One round: None while running; an Outcome once the job succeeded or a node failed."""
        results: list[Seen] = [None] * len(self.specs)
        threads = [threading.Thread(target=self._poll_one, args=(r, results), daemon=True)
                   for r in range(len(self.specs))]
        threads.append(threading.Thread(target=self.refresh_beat, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 12
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        done = 0
        failed: list[tuple[float, int, str]] = []  # (seen exited at, on this machine's clock; rank; why)
        for rank, state in enumerate(results):
            if state is None or state.status == NO_API:
                if now - self.last_seen[rank] > UNREACHABLE_S:
                    return self._no_answer(rank, state, now)
                continue
            if isinstance(state, HostSeen):
                return Outcome(False, End.HOST, rank, state.cause)
            self.last_seen[rank] = now
            if rank == 0 and self.stall.started_at is None:  # node 0's clock, as the heartbeat's `time`
                self.stall.started_at = state.started_at
            if state.status == REMOVED:
                return Outcome(False, End.REMOVED, rank, "its container was removed (stopped with 'kill'?)")
            if state.ended:
                if state.exit_code != 0:
                    why = (oom_reason(self.specs[rank].memory) if state.oom_killed
                           else self._exit_reason(rank, state.exit_code))
                    failed.append((self.exit_seen[rank] or now, rank, why))
                done += 1
        if failed and any(s is None or s.status == NO_API for s in results):
            return None  # a node's Docker or host does not answer (a restart, a reboot): its peers' exits follow
        if failed:
            # Name the node that went first: the others usually fail *because* it did (a lost peer).
            _, rank, why = min(failed)
            return Outcome(False, End.EXITED, rank, why)
        if done == len(self.specs):
            return Outcome(True, End.DONE)
        idle = self.stall.stalled_for(now)
        if idle is None:
            return None
        limit = f"(--stall-timeout {self.stall.limit_s():.0f} s)"
        if done:  # the others ended well, and the heartbeat with them: a rank that never returns (a hung teardown)
            return Outcome(False, End.STALLED, None, f"{len(self.specs) - done} node(s) still running {idle:.0f} s "
                                                     f"after the last beat, though {done} ended with exit 0 {limit}")
        step = self.beat.step if self.beat else "?"
        return Outcome(False, End.STALLED, None, f"no training progress for {idle:.0f} s after step {step} {limit}")

    def _no_answer(self, rank: int, state: Seen, now: float) -> Outcome:
        if not isinstance(state, HostSeen):
            # Stopping the job and finding the newest checkpoint skip it now rather than time out there again.
            self.ranks.lose(rank, f"it answered nothing for {now - self.last_seen[rank]:.0f} s")
            return Outcome(False, End.UNREACHABLE, rank, f"host unreachable for {UNREACHABLE_S:.0f} s")
        return Outcome(False, End.HOST, rank, f"{state.cause} for {UNREACHABLE_S:.0f} s")

    def refresh_beat(self) -> None:
        try:
            beat = read_beat(partial(self.ranks.read_file, 0), self.specs[0].dirs["ckpt"])
        except Exception:  # node 0 unreachable: the container polls tell
            return
        self.stall.update(beat, time.monotonic())

    @property
    def beat(self) -> Beat | None:
        """Rank 0's newest heartbeat of THIS attempt (progress line, stall reports); None until one is known."""
        return self.stall.this_run()

    def collect_stacks(self) -> list[RankStack]:
        """SIGUSR1 to every rank of every node (faulthandler dumps, docs/DESIGN.md §7), then read the dumps from
        each node's log dir until every rank wrote one that stopped growing, or STACK_WAIT_S passed (a stopped
        rank never writes)."""
        signalled = fan_out("stack dump", list(range(len(self.specs))), self._signal, lambda r: self.specs[r].host.label)
        deadline = time.monotonic() + STACK_WAIT_S
        previous: list[RankStack] = []
        while True:
            stacks = [s for r, ranks in enumerate(signalled)
                      for s in read_stacks(partial(self.ranks.read_file, r), self.specs[r].dirs["log"], r, ranks)]
            if (stacks == previous and all(s.text for s in stacks)) or time.monotonic() > deadline:
                return stacks
            previous = stacks
            time.sleep(1.0)

    def _signal(self, rank: int) -> list[int]:
        try:
            return self.ranks.signal_ranks(rank)
        except Exception:  # an unreachable node has no dumps to give; the others still do
            return []

    def _poll_one(self, rank: int, results: list[Seen]) -> None:
        try:
            state = self.ranks.state(rank)
            # None: the host answered that the container is gone (the host is not)
            results[rank] = RankState(REMOVED) if state is None else self._exit_of_a_restart(rank, state)
        except Exception:  # the API failed: ask the host itself why (unreachable or slow: counted by last_seen)
            results[rank] = self._host_state(rank)

    def _exit_of_a_restart(self, rank: int, state: RankState) -> Seen:
        """A failed container on a host whose daemon restarted (or that rebooted) since the job started: the
        restart ended it, whatever its exit code says (a quick restart answers the next poll as if nothing
        happened)."""
        if not state.ended or state.exit_code == 0:
            return state
        host = self._host_state(rank)
        return host if host is not None and host.status == HOST_CHANGED else state

    def _host_state(self, rank: int) -> HostSeen | None:
        """None: the host does not answer over SSH. A daemon that is down fails the node only once it stays down
        UNREACHABLE_S (a restart brings it back in seconds, then it counts as restarted)."""
        try:
            now = self.ranks.boot(rank)
        except SSHError:  # lost already (a poll still under way when the watch ended)
            return None
        if now is None:
            return None
        seen = change(self.boots[rank], now)
        cause = seen.cause(self.specs[rank].host.label)
        return HostSeen(HOST_CHANGED if seen.ended_the_job else NO_API, cause)

    def _exit_reason(self, rank: int, code: int) -> str:
        """torchrun exits 1 whatever its workers' codes: a diverged run is told apart by the trainer's line."""
        line = diverged_line(self.last_lines(rank, DIVERGED_TAIL)) if code in (1, EXIT_DIVERGED) else None
        return line or f"exited with code {code}"

    def last_lines(self, rank: int, tail: int = LAST_LINES) -> str:
        try:
            return self.ranks.last_lines(rank, tail)
        except Exception as err:
            return f"(logs unavailable: {err})"


def watch_until_end(watcher: Watcher, view: ProgressView) -> Outcome:
    """Poll until the attempt ends (the progress line shown meanwhile); how it ended."""
    while True:
        outcome = watcher.poll()
        if outcome is not None and outcome.ok:
            watcher.refresh_beat()  # the last beat ("done") may have come after this round's read
        view.show(watcher.beat)
        if outcome is not None:
            return outcome
        watcher.exited.wait(POLL_S)
        watcher.exited.clear()


def blame_a_host_change(watcher: Watcher, outcome: Outcome) -> Outcome:
    """A daemon that is stopping still answers for a moment that its containers exited: only once the job is
    stopped can a restart (or a reboot, or a daemon now down) be seen. Then it, not the exit code, is the cause:
    the outcome returned blames it."""
    for rank in range(len(watcher.specs)):
        seen = _host_change(watcher, rank)
        deadline = time.monotonic() + HOST_BACK_S
        # A restart brings dockerd back in seconds; a reboot has sshd down until its daemons are up again.
        while seen in (None, Change.DAEMON_DOWN) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            seen = _host_change(watcher, rank)
        if seen not in (None, Change.NONE):
            outcome = replace(outcome, end=End.HOST, failed_rank=rank, reason=seen.cause(watcher.specs[rank].host.label))
            watcher.console.print(f"[bold red]node {rank} ({watcher.specs[rank].host.label}) failed first: "
                                  f"{outcome.reason}[/]")
            return outcome
    return outcome


def _host_change(watcher: Watcher, rank: int) -> Change | None:
    """What happened to the host since the job started; None while it does not answer over SSH."""
    now = watcher.ranks.boot(rank)
    return change(watcher.boots[rank], now) if now is not None else None


