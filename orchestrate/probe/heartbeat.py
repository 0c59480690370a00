"""Rank 0's heartbeat (docs/DESIGN.md §2), read through whatever reads the node's files (the scheduler's Ranks for the
watcher, the SSH connection for `status`): what `up`'s progress line and `status` show."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainer import contract, straggler
from trainer.contract import HEARTBEAT_FILE

NODE_LINE_WIDTH = 100  # status's node lines: one terminal line each
# Reads one node's file: (its path on the node's host, timeout in seconds) -> its bytes; OSError when there is none.
ReadFile = Callable[[str, float], bytes]


@dataclass(frozen=True)
class Beat(contract.Beat):
    """One heartbeat as the trainer writes it and contract.Beat reads it, and how `up` and `status` show it."""

    def progress_line(self) -> str:
        """PURE: `step 120/600 (20%) epoch 3/15 loss 1.234 412 img/s ETA 0h05m12s`."""
        parts = [f"step {self.step}/{self.total_steps}" if self.total_steps else f"step {self.step}"]
        if self.total_steps:
            parts[0] += f" ({100 * self.step / max(self.total_steps, 1):.0f}%)"
        if self.epoch is not None:
            parts.append(f"epoch {self.epoch}/{self.epochs}" if self.epochs else f"epoch {self.epoch}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.images_per_s is not None:
            parts.append(f"{self.images_per_s:.0f} img/s")
        if self.eta_s is not None:
            parts.append(f"ETA {hms(self.eta_s)}")
        if self.state not in ("training", "starting"):
            parts.append(self.state)
        return " ".join(parts)

    def straggler_line(self) -> str | None:
        """PURE: `slowest: node 2 rank 5, 1.9x the median step` when a rank is clearly slower than the median
        for several windows (straggler.slowest), else None."""
        found = straggler.slowest(self)
        return found.line() if found is not None else None

    def node_lines(self, hosts: Mapping[int, str], gpus: Mapping[int, str], width: int = NODE_LINE_WIDTH) -> list[str]:
        """PURE: one line per node (`hosts`: node rank -> host label): its ranks' step, own work with its score,
        and data wait (from every rank's timings), and its GPUs' use (`gpus`: node rank -> gpu_usage text).
        None of a node's parts known: no line for it."""
        per = max(1, self.ranks_per_node or 1)
        times = {n: part for n, part in enumerate(self._node_timings(per))}
        lines = []
        for node in sorted(set(hosts) | set(times) | set(gpus)):
            parts = [p for p in (times.get(node), gpus.get(node)) if p]
            if parts:
                lines.append(keep_head(f"node {node} {hosts.get(node, '?')}: " + " | ".join(parts), width))
        return lines

    def _node_timings(self, per: int) -> list[str]:
        work, step, data = self.rank_work_s, self.rank_step_s, self.rank_data_s
        if not work or not step or not data or not len(work) == len(step) == len(data):
            return []
        scores = straggler.straggler_scores(straggler.node_times(work, per))
        return [f"step {max(step[i:i + per]):.3g} s, work {max(work[i:i + per]):.3g} s "
                f"({scores[i // per]:.1f}x), data {max(data[i:i + per]):.3g} s" for i in range(0, len(work), per)]



def keep_head(text: str, width: int) -> str:
    """PURE: `text` cut to `width` characters, marked with an ellipsis."""
    return text if len(text) <= width else text[:width - 1] + "…"


def hms(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def read_beat(read_file: ReadFile, ckpt_dir: str) -> Beat | None:
    """The heartbeat in the node's `ckpt_dir`; None when there is none or it is not a heartbeat."""
    try:
        return Beat.parse(read_file(posixpath.join(ckpt_dir, HEARTBEAT_FILE), 10).decode(errors="replace"))
    except OSError:  # no heartbeat yet (or not this kind of program)
        return None
