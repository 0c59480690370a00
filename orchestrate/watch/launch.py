"""Apply a plan: find the resume checkpoint, start one container per node, stream the logs, watch, stop on failure."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rich.console import Console

from orchestrate.config import UpConfig, secret_values
from orchestrate.errors import NoCheckpointError
from orchestrate.jobs.control import LogResume, follow_lines, kill_job, kill_on_host, print_lines, uid_of
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.probe.checkpoints import (
    Checkpoint,
    Replicator,
    copy_checkpoint,
    last_metrics,
    newest_valid,
    validate,
)
from orchestrate.probe.hostboot import Boot, Change, change, read_boot
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out
from orchestrate.watch.hangup import Hangup, TerminalGone
from orchestrate.watch.health import (
    STACK_WAIT_S,
    Beat,
    RankStack,
    StallClock,
    culprits,
    flight_recorder_lines,
    read_beat,
    read_fr_dumps,
    read_stacks,
    signal_ranks,
)
from trainer.contract import DIVERGED_LINE, EXIT_DIVERGED, METRICS_FILE, STOP_LINE

POLL_S = 2.0
REMOVED = "removed"  # a pseudo-status: the daemon answered that the container no longer exists
HOST_CHANGED = "host changed"  # a pseudo-status: the Docker API failed and the host rebooted or dockerd restarted
NO_API = "no api"  # a pseudo-status: the Docker API failed while sshd answers
UNREACHABLE_S = 15.0  # a host that answers no poll for this long counts as down
# After a job ended on an exit: how long a host that does not answer SSH (rebooting: sshd starts after dockerd) or
# whose dockerd is down gets to come back and say whether it rebooted or restarted, which then is the cause.
HOST_BACK_S = 60.0
LAST_LINES = 20
FR_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # set by plan.py for GPU jobs: where torch's flight recorder dumps go
DIVERGED_TAIL = 100  # torchrun's failure summary (traceback and table) follows the trainer's line
FAILED_GRACE_S = 10.0
STREAM_DRAIN_S = 2.0  # at most this long for the log streams' last lines once the job has ended
STREAM_RETRY_S = 1.0  # a node's log stream broke while its container runs: follow it again this much later
PROGRESS_EVERY_S = 30.0  # without a terminal (CI, a pipe), a progress line this often instead of a live one


# ---- resume ------------------------------------------------------------------------------------------


def find_resume_checkpoint(nodes: Nodes, specs: Sequence[NodeSpec], console: Console) -> Checkpoint:
    """The newest valid checkpoint on any node; copied to nodes that lack it so every rank can load it. A newer
    checkpoint that fails its manifest's size or sha256 is skipped with a warning."""
    def search(r: int) -> Checkpoint | None:
        def skipped(path: str) -> None:
            console.print(f"warning: {nodes.hosts[r].label}:{path}: the checkpoint does not match its manifest "
                          "(missing, or another size or sha256): skipped", markup=False, highlight=False)
        return newest_valid(nodes.conn(r), specs[r].dirs["ckpt"], skipped)

    found = fan_out("checkpoint search", list(range(len(specs))), search, lambda r: nodes.hosts[r].label)
    valid = [c for c in found if c is not None]
    if not valid:
        dirs = ", ".join(f"{s.host.label}:{s.dirs['ckpt']}" for s in specs)
        raise NoCheckpointError(f"--resume: no valid checkpoint of this job in {dirs}; start it without --resume")
    best = max(valid, key=lambda c: c.step)
    src = next(r for r, c in enumerate(found) if c is not None and c.step == best.step)
    console.print(f"resuming from {best.host}:{best.path} (epoch {best.epoch}, step {best.step}, "
                  f"sha256 verified)", markup=False, highlight=False)
    for rank, spec in enumerate(specs):
        have = found[rank]
        if rank != src and (have is None or have.step != best.step):
            if validate(nodes.conn(rank), spec.dirs["ckpt"], best.manifest_name) is None:
                copy_checkpoint(nodes.conn(src), best, nodes.conn(rank), spec.dirs["ckpt"])
    return best


# ---- start -------------------------------------------------------------------------------------------


def remove_leftovers(nodes: Nodes, config: UpConfig, grace: float, ranks: Sequence[int]) -> None:
    """Exited containers of the job (or, with --replace, running ones) are removed before the new start.

    `ranks`: the nodes where preflight found containers of the job.
    """
    fan_out("cleanup", list(ranks), lambda r: kill_on_host(nodes.docker(r), config.job, grace, nodes.hosts[r].label,
                                                  uid_of(nodes, r)),
            lambda r: nodes.hosts[r].label)


def start_containers(nodes: Nodes, specs: Sequence[NodeSpec],
                     before_start: Callable[[list[Any]], None] | None = None) -> list[Any]:
    """Create every container first, then start them all. If a create or a start fails on any node, every
    container already created (on the other nodes too) is removed: a failed launch leaves nothing behind.
    `before_start` sees every created container before any starts; what it raises removes them the same way
    (the GPU-set claim check, apply/claim.py)."""
    created: list[Any] = [None] * len(specs)

    def create(r: int) -> Any:
        created[r] = _create(nodes.docker(r), specs[r])
        return created[r]

    ranks = list(range(len(specs)))
    try:
        fan_out("create", ranks, create, lambda r: specs[r].host.label)
        if before_start is not None:
            before_start(created)
        fan_out("start", ranks, lambda r: created[r].start(), lambda r: specs[r].host.label)
    except Exception:
        for c in created:
            try:
                if c is not None:
                    c.remove(force=True)
            except Exception:  # best effort; the failure itself is raised below
                pass
        raise
    return created


def _create(client: Any, spec: NodeSpec) -> Any:
    kwargs = spec.sdk_kwargs()
    kwargs.pop("detach")
    return client.containers.create(**kwargs)


# ---- watch -------------------------------------------------------------------------------------------


class End(Enum):
    """How an attached `up` ended; callers decide on this, never on the wording of `reason`."""

    DONE = "done"
    DETACHED = "detached"  # Ctrl-C, the user chose to leave the job running
    INTERRUPTED = "interrupted"  # Ctrl-C, the job was stopped
    EXITED = "exited"  # a node's container exited non-zero (or was OOM-killed)
    UNREACHABLE = "unreachable"  # a host answered no poll for UNREACHABLE_S
    STALLED = "stalled"  # no new training step (rank 0's heartbeat) for --stall-timeout
    REMOVED = "removed"  # a node's container is gone (another terminal ran `kill`)
    HOST = "host"  # a node's host rebooted, or its Docker daemon restarted or is down while sshd answers

    @property
    def restartable(self) -> bool:
        """Failures of the job itself; a user's kill or Ctrl-C is never undone by a restart."""
        return self in (End.EXITED, End.UNREACHABLE, End.STALLED, End.HOST)


@dataclass
class Outcome:
    ok: bool
    end: End
    failed_rank: int | None = None
    reason: str = ""
    leftovers: bool = False  # some node could not be cleaned (unreachable): `kill` later
    host: str | None = None  # the failed node's host

    @property
    def cause(self) -> str:
        """One line for errors, the restart record and `status`: which node, what happened."""
        if self.failed_rank is None:
            return self.reason
        return f"node {self.failed_rank} ({self.host}) {self.reason}" if self.host else \
            f"node {self.failed_rank} {self.reason}"


class Watcher:
    """Streams every node's log with a `[node R]` prefix, learns of each container's exit from the Docker API's
    wait, and polls each container's state with a timeout (which also finds unreachable hosts).

    SSH channels held per host while watching: the log stream, the wait, and the polls' pooled connection: 3.
    """

    def __init__(self, nodes: Nodes, specs: Sequence[NodeSpec], containers: Sequence[Any], console: Console,
                 secrets: list[str], stall_timeout: float = 0.0) -> None:
        self.nodes, self.specs, self.console, self.secrets = nodes, specs, console, secrets
        self.containers = list(containers)
        self.ids = [c.id for c in containers]
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
        self.boots = fan_out("boot check", list(range(len(self.specs))), lambda r: read_boot(self.nodes.conn(r)),
                             lambda r: self.specs[r].host.label)

    def start_streams(self) -> None:
        for rank in range(len(self.specs)):
            self.streams.append(threading.Thread(target=self._stream, args=(rank,), daemon=True))
        for t in self.streams:
            t.start()

    def _stream(self, rank: int) -> None:
        try:
            # A client without a read timeout: logs may be quiet for long; liveness is the poller's job.
            # Made here, once per node, then shared with the wait (Nodes.docker is not for concurrent first use).
            client = self.nodes.docker(rank, timeout=None)
        except Exception:  # unreachable: the poller reports it
            self.exited.set()
            return
        threading.Thread(target=self._wait, args=(client, rank), daemon=True).start()
        resume = LogResume()
        while not self.stop_event.is_set():
            try:
                chunks = client.api.logs(self.ids[rank], stream=True, follow=True, timestamps=True,
                                         since=resume.since())
                follow_lines(self.console, rank, resume.unstamped(chunks), self.secrets, self.stop_event)
            except Exception:  # the stream is best effort; the poller decides what happened
                pass
            # The stream ends with the container (then at once: `up` waits for the last lines), or with a
            # dropped connection while it runs on: then follow again from the last line shown (the connection
            # is opened anew), until the job's end stops us.
            if not self._running(client, rank) or self.stop_event.wait(STREAM_RETRY_S):
                return

    def _running(self, client: Any, rank: int) -> bool:
        try:
            return bool(client.api.inspect_container(self.ids[rank])["State"]["Running"])
        except Exception:  # unreachable for now: try again while the job lasts
            return True

    def _wait(self, client: Any, rank: int) -> None:
        """Block in the daemon's wait until the container exits: the exit is seen at once, without polling."""
        try:
            client.api.wait(self.ids[rank])
            self.exit_seen[rank] = time.monotonic()
        except Exception:  # unreachable or removed: the poller tells which
            pass
        self.exited.set()

    def drain_streams(self, timeout: float) -> None:
        """Let the log streams print the last lines: they end with their containers (bounded wait)."""
        deadline = time.monotonic() + timeout
        for t in self.streams:
            t.join(max(0.0, deadline - time.monotonic()))

    def _state(self, rank: int) -> dict[str, Any]:
        # The client the earlier phases used (its idle pooled channel): no extra channel for the polls.
        return dict(self.nodes.docker(rank).api.inspect_container(self.ids[rank])["State"])

    def poll(self) -> Outcome | None:
        """One round: None while running; an Outcome once the job succeeded or a node failed."""
        results: list[dict[str, Any] | None] = [None] * len(self.specs)
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
            if state is None or state["Status"] == NO_API:
                if now - self.last_seen[rank] > UNREACHABLE_S:
                    return self._no_answer(rank, state)
                continue
            if state["Status"] == HOST_CHANGED:
                return Outcome(False, End.HOST, rank, state["Cause"])
            self.last_seen[rank] = now
            if rank == 0 and self.stall.started_at is None:  # node 0's clock, as the heartbeat's `time`
                self.stall.started_at = docker_time(str(state.get("StartedAt", "")))
            status, code = state.get("Status"), int(state.get("ExitCode", 0))
            if status == REMOVED:
                return Outcome(False, End.REMOVED, rank, "its container was removed (stopped with 'kill'?)")
            if status in ("exited", "dead"):
                if code != 0:
                    why = oom_reason(self.specs[rank].memory) if state.get("OOMKilled") else self._exit_reason(rank, code)
                    failed.append((self.exit_seen[rank] or now, rank, why))
                done += 1
        if failed and any(s is None or s["Status"] == NO_API for s in results):
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

    @staticmethod
    def _no_answer(rank: int, state: dict[str, Any] | None) -> Outcome:
        if state is None:
            return Outcome(False, End.UNREACHABLE, rank, f"host unreachable for {UNREACHABLE_S:.0f} s")
        return Outcome(False, End.HOST, rank, f"{state['Cause']} for {UNREACHABLE_S:.0f} s")

    def refresh_beat(self) -> None:
        try:
            beat = read_beat(self.nodes.conn(0), self.specs[0].dirs["ckpt"])
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
                      for s in read_stacks(self.nodes.conn(r), self.specs[r].dirs["log"], r, ranks)]
            if (stacks == previous and all(s.text for s in stacks)) or time.monotonic() > deadline:
                return stacks
            previous = stacks
            time.sleep(1.0)

    def _signal(self, rank: int) -> list[int]:
        try:
            return signal_ranks(self.nodes.docker(rank).containers.get(self.ids[rank]))
        except Exception:  # an unreachable node has no dumps to give; the others still do
            return []

    def _poll_one(self, rank: int, results: list[dict[str, Any] | None]) -> None:
        import docker.errors

        try:
            results[rank] = self._exit_of_a_restart(rank, self._state(rank))
        except docker.errors.NotFound:  # the host answered: the container is gone, not the host
            results[rank] = {"Status": REMOVED}
        except Exception:  # the API failed: ask the host itself why (unreachable or slow: counted by last_seen)
            results[rank] = self._host_state(rank)

    def _exit_of_a_restart(self, rank: int, state: dict[str, Any]) -> dict[str, Any]:
        """A failed container on a host whose daemon restarted (or that rebooted) since the job started: the
        restart ended it, whatever its exit code says (a quick restart answers the next poll as if nothing
        happened)."""
        if state.get("Status") not in ("exited", "dead") or int(state.get("ExitCode", 0)) == 0:
            return state
        host = self._host_state(rank)
        return host if host is not None and host["Status"] == HOST_CHANGED else state

    def _host_state(self, rank: int) -> dict[str, Any] | None:
        """None: the host does not answer over SSH. A daemon that is down fails the node only once it stays down
        UNREACHABLE_S (a restart brings it back in seconds, then it counts as restarted)."""
        now = read_boot(self.nodes.conn(rank))
        if now is None:
            return None
        seen = change(self.boots[rank], now)
        cause = seen.cause(self.specs[rank].host.label)
        return {"Status": HOST_CHANGED if seen.ended_the_job else NO_API, "Cause": cause}

    def _exit_reason(self, rank: int, code: int) -> str:
        """torchrun exits 1 whatever its workers' codes: a diverged run is told apart by the trainer's line."""
        line = diverged_line(self.last_lines(rank, DIVERGED_TAIL)) if code in (1, EXIT_DIVERGED) else None
        return line or f"exited with code {code}"

    def last_lines(self, rank: int, tail: int = LAST_LINES) -> str:
        try:
            return self.nodes.docker(rank).api.logs(self.ids[rank], tail=tail).decode(
                errors="replace")
        except Exception as err:
            return f"(logs unavailable: {err})"


def diverged_line(log: str) -> str | None:
    """PURE: the trainer's divergence report (`error: training diverged at step N: loss L, lr R; ...`) from a
    node's log, without its `error: `; None when the node ended otherwise."""
    for line in reversed(log.splitlines()):
        _, found, rest = line.partition(f"error: {DIVERGED_LINE}")
        if found:
            return f"{DIVERGED_LINE}{rest}".strip()
    return None


def oom_reason(limit: str | None) -> str:
    """PURE: why a container that the kernel's OOM killer ended (Docker's State.OOMKilled) failed, and what to do."""
    where = f"its memory limit (--memory {limit})" if limit else "the host's memory (no --memory limit)"
    return (f"killed by the kernel's OOM killer: out of {where}; lower --batch-size, or give it more memory "
            "with --memory (/dev/shm counts too: --shm-size)")


def docker_time(stamp: str) -> float | None:
    """PURE: epoch seconds of one of Docker's RFC 3339 UTC times (a fraction of up to 9 digits, which datetime
    does not take: cut to microseconds); None for an empty, a zero (never) or a malformed one."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        at = datetime.datetime.fromisoformat(f"{head}.{frac[:6].ljust(6, '0')}+00:00").timestamp()
    except ValueError:
        return None
    return at if at > 0 else None


class ProgressView:
    """Rank 0's heartbeat as one line under the streamed logs: live on a terminal (rich), else printed every
    PROGRESS_EVERY_S seconds (a CI log gets a line now and then, not a redraw per poll)."""

    def __init__(self, console: Console) -> None:
        from rich.live import Live

        self.console = console
        self.live = Live(console=console, transient=True, auto_refresh=False) if console.is_terminal else None
        self.printed_at = 0.0
        self.shown: str | None = None
        if self.live is not None:
            self.live.start()

    def show(self, beat: Beat | None) -> None:
        if beat is None or beat.raw == self.shown:
            return
        self.shown = beat.raw
        line = f"progress: {beat.progress_line()}"
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(line, style="bold"), refresh=True)
        elif time.monotonic() - self.printed_at >= PROGRESS_EVERY_S or beat.state == "done":
            self.printed_at = time.monotonic()
            self.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def watch(nodes: Nodes, specs: Sequence[NodeSpec], containers: Sequence[Any], config: UpConfig,
          console: Console, hangup: Hangup) -> Outcome:
    """Stay attached until the job succeeds or a node fails; on failure stop the job everywhere. Meanwhile:
    progress from the heartbeat, each new checkpoint replicated off node 0. The terminal going away (SIGHUP) ends
    the watch and leaves the job running."""
    watcher = Watcher(nodes, specs, containers, console, secret_values(config.env_dict), config.stall_timeout)
    replicator = Replicator(nodes, specs, config.ckpt_mirror, console)
    view = ProgressView(console)
    watcher.read_boots()
    watcher.start_streams()
    replicator.start()
    try:
        with hangup.watching():
            outcome = _watch_until_end(watcher, view)
    except KeyboardInterrupt:
        watcher.stop_event.set()
        view.close()
        replicator.stop()
        return _interrupted(nodes, config, console)
    except TerminalGone:
        watcher.stop_event.set()
        replicator.stop()
        return Outcome(True, End.DETACHED, None, "the terminal went away (SIGHUP)")
    finally:
        view.close()
    replicator.stop()
    watcher.drain_streams(STREAM_DRAIN_S)
    watcher.stop_event.set()
    if not outcome.ok:
        _report_failure(watcher, outcome, config)
        console.print(f"stopping job {config.job!r} on all nodes", markup=False)
        try:
            # Short grace: with a peer gone the others cannot agree on a checkpoint anyway.
            kill_job(nodes, config.job, min(config.grace, FAILED_GRACE_S), console)
        except Exception as err:  # reported; the job failure is what matters
            console.print(f"while stopping: {err}", markup=False, highlight=False)
            outcome.leftovers = True
        if outcome.end is End.EXITED:
            _blame_a_host_change(watcher, outcome)
    return outcome


def _watch_until_end(watcher: Watcher, view: ProgressView) -> Outcome:
    while True:
        outcome = watcher.poll()
        if outcome is not None and outcome.ok:
            watcher.refresh_beat()  # the last beat ("done") may have come after this round's read
        view.show(watcher.beat)
        if outcome is not None:
            return outcome
        watcher.exited.wait(POLL_S)
        watcher.exited.clear()


def _blame_a_host_change(watcher: Watcher, outcome: Outcome) -> None:
    """A daemon that is stopping still answers for a moment that its containers exited: only once the job is
    stopped can a restart (or a reboot, or a daemon now down) be seen. Then it, not the exit code, is the cause."""
    for rank in range(len(watcher.specs)):
        seen = _host_change(watcher, rank)
        deadline = time.monotonic() + HOST_BACK_S
        # A restart brings dockerd back in seconds; a reboot has sshd down until its daemons are up again.
        while seen in (None, Change.DAEMON_DOWN) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            seen = _host_change(watcher, rank)
        if seen not in (None, Change.NONE):
            outcome.end, outcome.failed_rank, outcome.reason = End.HOST, rank, seen.cause(watcher.specs[rank].host.label)
            watcher.console.print(f"[bold red]node {rank} ({watcher.specs[rank].host.label}) failed first: "
                                  f"{outcome.reason}[/]")
            return


def _host_change(watcher: Watcher, rank: int) -> Change | None:
    """What happened to the host since the job started; None while it does not answer over SSH."""
    now = read_boot(watcher.nodes.conn(rank))
    return change(watcher.boots[rank], now) if now is not None else None


def _report_failure(watcher: Watcher, outcome: Outcome, config: UpConfig) -> None:
    console, specs = watcher.console, watcher.specs
    if outcome.end is End.STALLED:
        console.print(f"[bold red]job stalled: {outcome.reason}[/]")
        _report_stall(watcher, outcome)
        return
    rank = outcome.failed_rank if outcome.failed_rank is not None else 0
    console.print(f"[bold red]node {rank} ({specs[rank].host.label}) failed: {outcome.reason}[/]")
    if outcome.end is End.EXITED:  # its logs are there to show
        lines = watcher.last_lines(rank)
        console.print(f"last lines of node {rank}:", markup=False)
        print_lines(console, rank, lines, watcher.secrets)
        if STOP_LINE in lines:
            console.print("the trainer got SIGTERM (kill / docker stop) and wrote a checkpoint: "
                          f"continue with 'up --resume --job {config.job}'", markup=False)


def _report_stall(watcher: Watcher, outcome: Outcome) -> None:
    """Stack dumps of every rank, the node whose ranks are not where the others wait, and all of it saved in
    node 0's log dir (the ranks' own dump files start afresh with the next run)."""
    console, specs = watcher.console, watcher.specs
    stacks = watcher.collect_stacks()
    lines = []
    for s in stacks:
        what = ("waiting in a collective" if s.in_collective else
                "NO DUMP (stopped, or frozen outside Python)" if not s.text else "busy outside any collective")
        lines.append(f"rank {s.rank} on node {s.node} ({specs[s.node].host.label}): {what}")
    blamed = culprits(stacks)
    if blamed:
        outcome.failed_rank = blamed[0]
        names = ", ".join(f"node {n} ({specs[n].host.label})" for n in blamed)
        lines.append(f"stalled by {names}: its ranks are not in the collective the others wait in")
        outcome.reason += f"; stalled by {names}"
    elif stacks:
        lines.append("no single node to blame: every rank is in the same place (see the dumps)")
    if FR_ENV in specs[0].env:  # a GPU job: torch's flight recorder may have dumped (NCCL only)
        lines += flight_recorder_lines(_fr_dumps(watcher, stacks))
    if watcher.beat is not None:
        lines.append(f"last heartbeat: {watcher.beat.progress_line()} (slowest step so far "
                     f"{watcher.beat.slowest_step_s:.2f} s)")
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False)
    report = "\n".join([*lines, "", *(f"==== rank {s.rank} on node {s.node}\n{s.text or '(no dump)'}" for s in stacks)])
    path = f"{specs[0].dirs['log']}/stall-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.txt"
    try:
        watcher.nodes.conn(0).write_file(path, iter((report.encode(),)), timeout=60)
        console.print(f"stack dumps saved in {specs[0].host.label}:{path}", markup=False, highlight=False)
    except Exception as err:  # node 0 unreachable: the dumps were printed above
        console.print(f"could not save the stack dumps on node 0: {err}", markup=False, highlight=False)


def _fr_dumps(watcher: Watcher, stacks: Sequence[RankStack]) -> dict[int, bytes]:
    dumps: dict[int, bytes] = {}
    for node, spec in enumerate(watcher.specs):
        try:
            dumps.update(read_fr_dumps(watcher.nodes.conn(node), spec.dirs["log"],
                                       [s.rank for s in stacks if s.node == node]))
        except Exception:  # an unreachable node has no dumps to give; the others still do
            continue
    return dumps


def _interrupted(nodes: Nodes, config: UpConfig, console: Console) -> Outcome:
    stop = config.stop_on_interrupt
    if not stop:
        try:
            answer = console.input(f"\nStop job {config.job!r} on all nodes? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = "y"
        stop = answer.strip().lower() in ("y", "yes")
    if stop:
        kill_job(nodes, config.job, config.grace, console)
        return Outcome(False, End.INTERRUPTED, None, "stopped by Ctrl-C")
    console.print(f"job {config.job!r} keeps running; see it with 'status --job {config.job}', "
                  f"stop it with 'kill --job {config.job}'", markup=False)
    return Outcome(True, End.DETACHED, None, "detached")


def summary(nodes: Nodes, specs: Sequence[NodeSpec], console: Console) -> None:
    """Epochs, final accuracy (metrics.jsonl over SFTP) and where the checkpoints are."""
    folder = specs[0].dirs["ckpt"]
    metrics = last_metrics(nodes.conn(0), folder)
    newest = newest_valid(nodes.conn(0), folder)
    if metrics:
        console.print(f"finished: epochs={metrics.get('epoch')} step={metrics.get('step')} "
                      f"test_acc={metrics.get('test_acc')} world_size={metrics.get('world_size')}",
                      markup=False, highlight=False)
    else:
        console.print(f"finished (no {METRICS_FILE} found on node 0)", markup=False)
    where = f"{specs[0].host.label}:{newest.path}" if newest else f"{specs[0].host.label}:{folder} (none valid)"
    console.print(f"checkpoint: {where}", markup=False, highlight=False)


def newest_step(nodes: Nodes, specs: Sequence[NodeSpec]) -> int | None:
    """The newest valid checkpoint's step on the nodes that still answer (None: none anywhere)."""
    def one(rank: int) -> int | None:
        try:
            found = newest_valid(nodes.conn(rank), specs[rank].dirs["ckpt"])
        except Exception:  # an unreachable node has nothing to offer
            return None
        return found.step if found else None

    steps = [s for s in fan_out("checkpoint search", list(range(len(specs))), one, lambda r: specs[r].host.label)
             if s is not None]
    return max(steps, default=None)
