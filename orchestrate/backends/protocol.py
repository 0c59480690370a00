"""The Scheduler protocol: what the pipeline, `kill`/`status`/`logs` and the watcher ask of a scheduler, and the plain
data it answers with. A scheduler decides nothing: it carries out a plan and reports what it sees.

A second scheduler implements these methods in its own folder (`backends/NAME/`) and registers in
`backends/choice.py`'s SCHEDULERS; nothing above it names it. The protocol is generic over the connection a scheduler runs a
command over (NodesT): it never names one, so importing it loads neither paramiko nor docker-py (lint contract
`protocol-names-no-connection`); Docker over SSH fixes it to its SSH Session (remote/session.py). An allocator grants
the hosts and queues the batch jobs, while a Scheduler runs the containers on them: it implements Allocator and
registers in ALLOCATORS (allocators.py): its subcommands, its `--hosts` value, its side of `status` and `kill`, and its
hint on an SSH failure are asked of it there."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from rich.console import Console

from orchestrate.config import Data, Delivery, SSHOptions, UpConfig
from orchestrate.errors import ConfigError, MultiHostError
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import ContainerSpec, JobPlan
from orchestrate.probe.bootchange import Boot
from orchestrate.probe.daemons import Daemons, Local
from orchestrate.probe.observations import Checkpoint, Holdings

Request = dict[str, Any]  # JSON-ready, secrets masked
# The connection to the hosts that a scheduler runs a command over, opaque here: each scheduler names its own (Docker
# over SSH: one SSH Session to every host); whoever runs the command opens it (or has the scheduler open it: `reach`)
# and hands it to every call.
NodesT = TypeVar("NodesT")
# Plan the start again from what the hosts hold now (another job took part of the grant meanwhile): node 0's master
# port and every node's container, decided by the pipeline's plan, never by the scheduler.
Replan = Callable[[Sequence[Holdings]], tuple[int | None, list[ContainerSpec]]]


@dataclass(frozen=True)
class RankState:
    """One node's part of a running attempt, as the scheduler reports it."""

    status: str  # the scheduler's word: created, running, exited, dead, ...
    exit_code: int = 0
    oom_killed: bool = False
    started_at: float | None = None  # when it started, epoch seconds by the node's clock; None when unknown

    @property
    def ended(self) -> bool:
        return self.status in ("exited", "dead")


class Ranks(Protocol):
    """The watcher's view of one submitted attempt, node by node (node rank = index into the plan's nodes): the
    nodes' parts, the files they write and the hosts they run on, read however the scheduler reaches them (the
    watcher names no connection). Each method may raise when the host does not answer: the watcher then asks the
    host itself why (`boot`)."""

    def follow(self, rank: int) -> Iterator[bytes]:
        """The node's output as it comes; called again after a broken stream, it goes on after the last line
        given (none twice, none lost). It ends when the node's part ends."""
        ...

    def running(self, rank: int) -> bool:
        ...

    def wait_exit(self, rank: int) -> None:
        """Block until the node's part ends."""
        ...

    def state(self, rank: int) -> RankState | None:
        """Its state now; None when the scheduler answered that it no longer exists."""
        ...

    def last_lines(self, rank: int, tail: int) -> str:
        ...

    def signal_ranks(self, rank: int) -> list[int]:
        """SIGUSR1 to every training process of the node (stack dumps); the global ranks signalled."""
        ...

    def read_file(self, rank: int, path: str, timeout: float) -> bytes:
        """A file the node's part wrote, by its path on the node's host (in the plan's folders: the heartbeat, the
        stack dumps, the metrics), read within `timeout` s; OSError when there is none."""
        ...

    def write_file(self, rank: int, path: str, data: bytes, timeout: float) -> None:
        """Write `data` to `path` on the node's host, whole or not at all (a stall's report beside the ranks'
        dumps), within `timeout` s."""
        ...

    def newest_checkpoint(self, rank: int, folder: str) -> Checkpoint | None:
        """The newest checkpoint in the node's `folder` that checks out against its manifest (Docker over
        SSH: backends/docker_ssh/checkpoints.py); None when none does."""
        ...

    def boot(self, rank: int) -> Boot | None:
        """The node's host's boot and its daemon's start now, which the watcher compares with an earlier reading
        (probe/bootchange.py) to tell a reboot or a daemon restart from a node that merely stopped; None when the
        host does not answer. SSHError once the node is lost (`lose`)."""
        ...

    def lose(self, rank: int, why: str) -> None:
        """The node answered nothing for long: every later use of its host in this command (stopping the job,
        finding the newest checkpoint) fails at once with `why` instead of waiting out the timeouts again."""
        ...


class Replication(Protocol):
    """While an attempt runs: each new valid checkpoint of node 0 copied off it (to node 1, and to a mirror folder
    on this machine), in the background; training never waits for it."""

    def start(self) -> None:
        ...

    def stop(self) -> None:
        """Stop looking for new checkpoints (a copy under way finishes or fails on its own)."""
        ...

    def finish(self) -> None:
        """The job is done: its final checkpoint copied too, once the copy under way has ended; failures are
        printed, never raised."""
        ...


@dataclass(frozen=True)
class ShortRunResult:
    """A short container run to its end; or not started, and `error` says why in the scheduler's words."""

    exit_code: int | None  # None: it did not start
    output: str = ""  # stdout and stderr as they came
    stdout: str = ""
    error: str = ""


@dataclass(frozen=True)
class Submitted:
    """An attempt as it started: the plan that started (a lost claim planned it again), and the watcher's view of
    the nodes' parts it started (Docker over SSH: each node's container, over its session)."""

    plan: JobPlan
    ranks: Ranks


@dataclass(frozen=True)
class StatusRow:
    """One node of a job, as `status` shows it."""

    node: str
    host: str
    name: str  # the container (or the scheduler's job step)
    state: str
    exit: str
    uptime: str
    last_line: str
    checkpoint: str


@dataclass(frozen=True)
class JobStatus:
    rows: list[StatusRow]
    lines: list[str]  # the job's progress and restarts, one line each


@dataclass(frozen=True)
class JobRow:
    """One job of one owner on the hosts, as `status --all` shows it."""

    owner: str
    job: str
    nodes: str  # host labels, node rank order
    gpus: str
    age: str
    running: int  # containers running, of `containers`
    containers: int


@dataclass(frozen=True)
class NodeLog:
    """A node's log: its text, or with `follow` its chunks as they come."""

    node: int
    chunks: Iterator[bytes]
    secrets: list[str]  # masked wherever shown


@dataclass(frozen=True)
class RankFiles:
    """One global rank's stdout and stderr (torchrun's --log-dir), and with `follow` its new lines as they come."""

    node: int
    files: dict[str, str]  # "stdout"/"stderr" → text
    follow: Iterator[str] | None
    secrets: list[str]


@dataclass(frozen=True)
class Reached(Generic[NodesT]):
    """The hosts of a command as the scheduler reached them (`reach`): a host that does not answer is left out
    and named, never waited for."""

    nodes: NodesT  # the connection to those that answered, handed to every call
    hosts: Sequence[Host]  # every host asked: a host index in an answer is an index into these
    answered: Sequence[int]  # the indices of those that answered
    unreachable: dict[str, str]  # why each other did not, by label

    def label(self, host: int) -> str:
        return self.hosts[host].label


class Scheduler(Daemons[NodesT], Protocol[NodesT]):
    """A scheduler's answers: the probe's reads of its daemons (Daemons, probe/daemons.py, in the probe's types) and
    these."""

    def materialize(self, plan: JobPlan) -> Request:
        """PURE: the request submitted for the attempt's plan (`--dry-run=hosts --json` prints it)."""
        ...

    def text(self, plan: JobPlan) -> str:
        """PURE: the plan and its request as text (`--dry-run=hosts`)."""
        ...

    def materialize_offline(self, specs: Sequence[ContainerSpec]) -> Request:
        """PURE: the request of the containers of a plan made without probing (`--dry-run --json`)."""
        ...

    def containers_text(self, specs: Sequence[ContainerSpec]) -> str:
        """PURE: the same as text (`--dry-run`)."""
        ...

    def check_delivery(self, delivery: Delivery) -> None:
        """Before any host is contacted: ConfigError when this machine lacks what the delivery options ask for
        (`--layer-cache on`: the registry the layer cache runs)."""
        ...

    def fetch_script(self) -> str:
        """PURE: the program the plan's data fetch container runs (plan/shortlived.py), whose output the scheduler
        reads as it runs (`send_data`)."""
        ...

    def submit(self, nodes: NodesT, plan: JobPlan, grace: float, replan: Replan, console: Console) -> Submitted:
        """Start the attempt as planned: the job's leftovers the plan names removed (stopped with `grace`), then
        every node's part, all or none. Where another job took part of the grant meanwhile, `replan` plans again from what the hosts
        hold now (bounded tries). The answer carries what the watcher follows (`Submitted.ranks`)."""
        ...

    def run(self, nodes: NodesT, specs: Mapping[int, ContainerSpec], timeout: float, what: str,
            together: bool = False) -> dict[int, ShortRunResult]:
        """Run the plan's short containers (node rank → spec, plan/shortlived.py) to their end, each waited for at
        most `timeout` s, and remove them: one by one (one that cannot start is a ShortRunResult with its error), or
        `together`, one on every node, all created before any starts (they meet each other; one that cannot start
        removes them all and raises). `what` names them in errors (MultiHostError: one line per host)."""
        ...

    def image_check(self, nodes: NodesT, spec: ContainerSpec, local: Local) -> str:
        """The output of the plan's image check container (plan/shortlived.py) run to its end and removed, on node 0,
        or on this machine's image store `local` when given (the same image: the nodes get it from here);
        PreflightError when it cannot run."""
        ...

    def send_image(self, nodes: NodesT, plan: JobPlan, local: Local, local_id: str | None, delivery: Delivery,
                   console: Console) -> None:
        """The image onto every node as the plan says (`plan.nodes[].image`: present, pulled, or the layers it
        lacks sent from this machine's store `local`, or relayed); MultiHostError naming every node it failed on."""
        ...

    def send_data(self, nodes: NodesT, plan: JobPlan, data: Data, console: Console) -> None:
        """Every node's data as the plan says (`plan.nodes[].data`: fetched, its archive sent or relayed, the
        --data-from synced, or only the folders made), one line per node said on `console`."""
        ...

    def place_resume_checkpoint(self, nodes: NodesT, plan: JobPlan, say: Callable[[str], None]) -> None:
        """The plan's resume checkpoint put on the nodes that lack it (`plan.resume.copy_to`), so that every rank
        can load it; nothing without one. `say` is told how each got it (served by a node, or through here)."""
        ...

    def load_carried(self, manifest: Path, image: str, console: Console) -> None:
        """Load into this machine's image store the image `submit` carried through the shared storage (`manifest`,
        `--image-from`): only the layers it lacks, each checked by digest; nothing when it holds the image."""
        ...

    def replicate(self, nodes: NodesT, specs: Sequence[ContainerSpec], mirror: Path | None,
                  console: Console) -> Replication:
        """The replication of the attempt's checkpoints off node 0 (to node 1, and into `mirror` on this machine
        with --ckpt-mirror), not started yet."""
        ...

    def reach(self, hosts: Sequence[Host], ssh: SSHOptions) -> AbstractContextManager[Reached[NodesT]]:
        """The connection to those of `hosts` that answer now (a host down is left out, not waited for), closed
        when the block ends."""
        ...

    def connect(self, hosts: Sequence[Host], ssh: SSHOptions, every: bool) -> Reached[NodesT]:
        """The connection to `hosts`, open until `close`: with `every`, to all of them (SSHError or MultiHostError
        naming each that does not answer: `up` starts nothing), otherwise to those that answer now, the others
        left out and named (a restart with --min-nodes)."""
        ...

    def await_hosts(self, hosts: Sequence[Host], ssh: SSHOptions, console: Console, timeout: float) -> None:
        """Before a restart that needs every host (plan/restarts.py): until each of `hosts` answers again, and its
        daemon too, at most `timeout` s, one line on `console` per wait; then the restart goes on either way (its
        preflight names a host still down). Over connections of its own, closed before it returns."""
        ...

    def keep(self, nodes: NodesT, hosts: Sequence[int]) -> NodesT:
        """The connection narrowed to `hosts` (indices into those it holds; in the answer, host i is `hosts[i]`),
        the others' closed: the hosts a restart runs on, as plan/restarts.py decided."""
        ...

    def close(self, nodes: NodesT) -> None:
        """The connection closed (best effort)."""
        ...

    def boot_and_driver(self, nodes: NodesT, rank: int) -> str:
        """The node's kernel boot id (new on every boot), then its GPU driver's version text (none without a
        driver): what a GPU probe that passed is remembered against (checks/gpuprobe.py); SSHError when unread."""
        ...

    def channels_held(self, nodes: NodesT) -> dict[str, int]:
        """The most channels held on each connected host at once, by label (`up --timings`)."""
        ...

    def read_file(self, nodes: NodesT, host: int, path: str) -> bytes:
        """A file on host `host` (an index into the hosts reached), by its path there (`plot` reads node 0's
        metrics, `tensorboard` its event files); OSError when there is none."""
        ...

    def files_named(self, nodes: NodesT, host: int, folder: str, prefix: str) -> list[tuple[str, int]]:
        """(path under `folder`, bytes) of every file under `folder` on host `host` whose name starts with
        `prefix` (`tensorboard`'s event files); none when there is no such folder."""
        ...

    def leave_stop_record(self, nodes: NodesT, job: str) -> dict[str, BaseException | str]:
        """`kill`'s stop record (jobs/stops.py) written on every reachable host; the hosts where it could not be,
        by label."""
        ...

    def stop_record_seen(self, nodes: NodesT, job: str) -> bool:
        """Whether any reachable host holds the job's stop record (a host that does not answer counts as none)."""
        ...

    def clear_stop_record(self, nodes: NodesT, job: str) -> None:
        """An earlier kill's stop record removed from every reachable host; MultiHostError where it cannot be."""
        ...

    def cancel(self, nodes: NodesT, job: str, grace: float, console: Console,
               unreachable: Mapping[str, BaseException | str] | None = None) -> None:
        """Stop the caller's job on every reachable host: SIGTERM, SIGKILL after `grace` s, then removed; one
        line per host. MultiHostError naming every host where it failed (and the `unreachable` ones)."""
        ...

    def remove(self, nodes: NodesT, job: str, grace: float, ranks: Sequence[int]) -> None:
        """The same, quietly, on the nodes `ranks`: leftovers before a start, or a start a `kill` raced."""
        ...

    def describe(self, nodes: NodesT, job: str, unreachable: Mapping[str, str]) -> JobStatus:
        """Each node's state of the caller's job (`status`); an unreachable host is one row saying so."""
        ...

    def logs(self, nodes: NodesT, job: str, node: int | None, tail: int, follow: bool) -> list[NodeLog]:
        """Each node's log (or one node's), node order; JobError when the job has none here."""
        ...

    def rank_logs(self, nodes: NodesT, job: str, rank: int, tail: int, follow: bool) -> RankFiles:
        """One global rank's files; JobError naming the ranks there are when there is no such rank."""
        ...

    def find(self, nodes: NodesT) -> list[JobRow]:
        """Every owner's jobs on the reachable hosts (`status --all`)."""
        ...

    def node_dirs(self, nodes: NodesT, job: str, mount: str) -> dict[int, tuple[int, str]]:
        """Node rank -> (host index, host folder seen in the job's containers at `mount`: CKPT_MOUNT or LOG_MOUNT)
        of the job's parts found (`tensorboard` reads the replica's log dir)."""
        ...

    def node0_dir(self, nodes: NodesT, job: str, remembered: str | None, mount: str) -> tuple[int, str]:
        """(host index, folder at `mount`) of the job's node 0, found running or, once gone, from the folder its
        last `up` was given (`remembered`): `plot` reads the checkpoint dir, `tensorboard` the log dir."""
        ...


@dataclass(frozen=True)
class Allocation:
    """The hosts an allocator granted the allocation this runs in: a hosts file (node 0 first, each node's GPU
    indices in its gpu_ids=), and the GPUs granted per node (0: none)."""

    hosts_file: Path
    gpus_per_node: int
    allocator: str  # its name in messages
    ask_gpus: str  # how one asks it for other GPUs (a flag of its own)

    def gpus(self, count: int) -> int:
        """`--gpus` inside the allocation: left out (all), the grant is taken; 0 runs on CPU regardless; another
        count given by hand is refused."""
        if count in (GPUS_ALL, self.gpus_per_node) or count == 0:
            return self.gpus_per_node if count == GPUS_ALL else count
        raise ConfigError(f"--gpus {count}: {self.allocator} granted {self.gpus_per_node} GPU(s) per node to this "
                          f"allocation; leave --gpus out to use them, or ask {self.allocator} for others "
                          f"({self.ask_gpus})")


class CommandLine(Protocol):
    """What the command line (cli.py) lends an allocator's subcommands, so that they read as its own."""

    def parser(self, command: str, description: str, options: type[Any]) -> argparse.ArgumentParser:
        """`python -m orchestrate COMMAND`'s parser, its options the flag fields of the dataclass `options` (each
        declared once with config.option); errors in one line (exit 2), --help as every command's."""
        ...

    def up_options(self, argv: Sequence[str]) -> argparse.Namespace:
        """`up`'s options parsed as `up` parses them: a typo fails here, naming `up`; a job file's (-f) under them,
        its `hosts =` aside, its args as `trainer_args`."""
        ...

    def up_config(self, ns: argparse.Namespace, hosts: Path, trainer: Sequence[str]) -> UpConfig:
        """Those options on `hosts`, with the trainer's, checked as `up` checks them."""
        ...

    def state_dir(self) -> Path:
        """The folder of this machine's job records (the jobs' memory, the allocators' records)."""
        ...


# An allocator's subcommand: (its arguments before '--', the trainer's after it, the command line's parsers, the
# console) → the exit status.
Command = Callable[[Sequence[str], Sequence[str], CommandLine, Console], int]


class Allocator(Protocol):
    """An allocator grants the hosts and queues the batch jobs, beside the Scheduler that runs the containers on them.
    The command line and `status`/`kill` ask every one in ALLOCATORS and name none."""

    hosts_help: str  # --hosts's help on the value it owns: "'NAME': ..."
    default_help: str  # --hosts's help on when that value is up's default
    examples: str  # --help's example lines of its subcommands
    summaries: Mapping[str, str]  # --help's one line on each of its subcommands, by name
    epilog: str  # --help's line on the value it owns

    @property
    def commands(self) -> Mapping[str, Command]:
        """Its own subcommands by name (`python -m orchestrate NAME ...`)."""
        ...

    def default_hosts(self) -> Path | None:
        """The `--hosts` value of `up` without one, when this runs inside one of its allocations; else None."""
        ...

    def allocation(self, hosts: Path, folder: Path) -> Allocation | None:
        """`--hosts` `hosts` when the value is its own: the allocation this runs in, its hosts file written in
        `folder`; None for any other value (a hosts file)."""
        ...

    def describe_job(self, job: str, console: Console, folder: Path) -> bool:
        """`status --job`: print its state of the caller's job; True when it knows the job (a job it still queues
        has no hosts nor containers). It asks only about a job its own subcommand queued and recorded in `folder`."""
        ...

    def cancel_job(self, job: str, console: Console, folder: Path) -> bool:
        """`kill --job`: cancel the caller's jobs of that name it queues or runs, one line each; True when it
        knows the job. It asks only about a job its own subcommand queued and recorded in `folder`."""
        ...

    def hint(self, err: MultiHostError, hosts_file: Path | None, folder: Path) -> MultiHostError:
        """`err` (hosts that failed `up` or `check`) with what the site must allow, where the hosts were its
        allocation's (`allocation` wrote `hosts_file` in `folder`); else `err` as it is."""
        ...
