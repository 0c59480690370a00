"""Is the job alive and moving? Rank 0's heartbeat (docs/DESIGN.md §2), the stall rule, stack dumps of every rank.

The heartbeat (on each poll) and the dumps are read through the scheduler's Ranks (its `read_file`); no torch here.
A program that writes no heartbeat gets no progress line and no stall check (its failures are still seen by exit
codes and host polls).
"""

from __future__ import annotations

import io
import pickle
import posixpath
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.probe.heartbeat import Beat, ReadFile
from trainer.contract import FR_DUMP_PREFIX, PEER_WAIT_FUNCTION, stack_file_name

STALL_STEP_FACTOR = 3.0  # a stall is never declared before 3x the slowest step seen
STACK_WAIT_S = 10.0  # how long the ranks get to write their dumps after SIGUSR1
# Frames of a rank that waits for its peers: a collective called from Python (torch.distributed), DDP's gradient
# all-reduce (it runs inside backward, where gloo blocks until every peer joins), and the trainer's one read of the
# agreement's result (with NCCL a collective returns once queued: that read is where the CPU waits). Only that
# function of trainer/dist.py: a rank elsewhere in it (picking its device) is not waiting for anyone.
# faulthandler writes a frame as `File "PATH", line N in NAME`.
COLLECTIVE_MARKERS = ("torch/distributed/distributed_c10d.py", "torch/nn/parallel/distributed.py",
                      "torch/autograd/", f" in {PEER_WAIT_FUNCTION}\n")


@dataclass
class StallClock:
    """PURE: the time of the last progress, by the orchestrator's own clock (the hosts' clocks may differ).

    Progress is any change of the heartbeat file. The check is armed once the file is known to be this run's:
    it changed while watched, or its `time` is after node 0's container started (both by node 0's clock). A
    stale file from an earlier run is no evidence of this one, and a start that takes long (a slow import, data
    on a network disk) is not a stall; a start that hangs before the first beat is torchrun's rendezvous
    timeout's to end. Without `time` (another program's beat), only a change arms it: a run that stops before
    the second beat read differs from the first is then left to --dist-timeout."""

    timeout_s: float
    last_change: float = field(default_factory=time.monotonic)
    last: Beat | None = None  # the beat as last read
    slowest_step_s: float = 0.0
    seen: bool = False
    started_at: float | None = None  # node 0's container start, epoch seconds by node 0's clock (docker inspect)

    def update(self, beat: Beat | None, now: float) -> None:
        if beat is None:
            return
        self.slowest_step_s = max(self.slowest_step_s, beat.slowest_step_s)
        if self.last is None or beat.raw != self.last.raw:
            if self.last is not None:
                self.seen = True  # a change we saw happen: this run writes a heartbeat
            self.last, self.last_change = beat, now

    @property
    def armed(self) -> bool:
        written_at = self.last.time if self.last else None
        return self.seen or (self.started_at is not None and written_at is not None and written_at >= self.started_at)

    def this_run(self) -> Beat | None:
        """The beat as last read once it is known to be this run's (`armed`), else None: a file left by an earlier
        run (its last line says `done`) is never shown as the progress of a run that has not taken a step."""
        return self.last if self.armed else None

    def limit_s(self) -> float:
        return max(self.timeout_s, STALL_STEP_FACTOR * self.slowest_step_s)

    def stalled_for(self, now: float) -> float | None:
        """Seconds without progress once over the limit; None while within it or when the check is off."""
        if self.timeout_s <= 0 or not self.armed:
            return None
        idle = now - self.last_change
        return idle if idle > self.limit_s() else None


# ---- stack dumps ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankStack:
    node: int
    rank: int
    text: str  # empty: no dump arrived

    @property
    def in_collective(self) -> bool:
        return any(marker in self.text for marker in COLLECTIVE_MARKERS)


def read_stacks(read_file: ReadFile, log_dir: str, node: int, ranks: Sequence[int]) -> list[RankStack]:
    out = []
    for rank in ranks:
        try:
            text = read_file(posixpath.join(log_dir, stack_file_name(rank)), 30).decode(errors="replace")
        except OSError:
            text = ""
        out.append(RankStack(node, rank, text))
    return out


# ---- the flight recorder (torch's ring of recent collectives per rank) ----------------------------------------

# plan.py points TORCH_FR_DUMP_TEMP_FILE at LOG_DIR/<this>; torch appends the global rank. torch writes the dump
# when NCCL's watchdog times out (TORCH_NCCL_DUMP_ON_TIMEOUT, after --dist-timeout): often later than the stall
# check, so the report uses what exists and says when there is none.
_FR_READ_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                   KeyError, LookupError, OverflowError, MemoryError)


class _PlainDataUnpickler(pickle.Unpickler):
    """A dump is a pickle of dicts, lists, strings and numbers only: no class may load (no torch, no code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def last_collective(dump: bytes) -> tuple[int, str] | None:
    """PURE: (sequence number, `NAME STATE`) of the newest collective in one rank's flight-recorder dump
    (torch's format: {"version", "pg_config", "entries": [{"collective_seq_id", "profiling_name", "state",
    "is_p2p", ...}]}); None for a dump that is not one."""
    try:
        data = _PlainDataUnpickler(io.BytesIO(dump)).load()
        entries = [e for e in data["entries"] if not e.get("is_p2p")]
        last = max(entries, key=lambda e: int(e["collective_seq_id"]))
        return int(last["collective_seq_id"]), f"{last.get('profiling_name', '?')} {last.get('state', '?')}"
    except _FR_READ_ERRORS:
        return None


def flight_recorder_lines(dumps: dict[int, bytes]) -> list[str]:
    """PURE: one line per rank's dump, and the ranks behind the others (their newest collective is older: they
    never reached the one the others wait in)."""
    if not dumps:
        return ["flight recorder: no dump (torch writes them only when NCCL's watchdog times out)"]
    seen = {rank: found for rank, dump in sorted(dumps.items()) if (found := last_collective(dump)) is not None}
    lines = [f"flight recorder of rank {rank}: last collective #{seq} {what}" for rank, (seq, what) in seen.items()]
    lines += [f"flight recorder of rank {rank}: unreadable dump" for rank in sorted(set(dumps) - set(seen))]
    newest = max((seq for seq, _ in seen.values()), default=0)
    behind = [rank for rank, (seq, _) in seen.items() if seq < newest]
    if behind:
        lines.append(f"flight recorder: rank(s) {', '.join(map(str, behind))} never reached collective #{newest}")
    return lines


def read_fr_dumps(read_file: ReadFile, log_dir: str, ranks: Sequence[int]) -> dict[int, bytes]:
    found = {}
    for rank in ranks:
        try:
            found[rank] = read_file(posixpath.join(log_dir, f"{FR_DUMP_PREFIX}{rank}"), 30)
        except OSError:  # none written (the usual case at a stall check)
            continue
    return found


def culprits(stacks: Sequence[RankStack]) -> list[int]:
    """PURE: the nodes to blame: those with a rank outside the collective that other ranks wait in (no dump:
    stopped, or frozen below Python; a dump elsewhere: busy or deadlocked outside the collective). Empty when
    no rank waits in a collective (nothing to compare with) or when every rank does (a slow network, a hung
    GPU collective: the dumps say more than a name)."""
    waiting = [s for s in stacks if s.in_collective]
    if not waiting:
        return []
    return sorted({s.node for s in stacks if not s.in_collective})
