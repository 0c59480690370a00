"""What rank 0 tells the world: log lines (non-main ranks quiet), the per-epoch metrics.jsonl, the heartbeat."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .atomic import write_atomic
from .contract import (
    ENV_LOG_DIR,
    ENV_RESTART,
    ENV_RESTART_CAUSE,
    HEARTBEAT_FILE,
    METRICS_FILE,
    STEP_KIND,
    TENSORBOARD_FOLDER,
    Beat,
)
from .hardware import Speed, mfu_text
from .straggler import node_times, straggler_scores, streaks

log = logging.getLogger(__name__)


def setup_logging(rank: int, is_main: bool) -> None:
    """Rank 0 logs INFO; the others only warnings and errors, so N processes do not print N copies."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    handler._trainer = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_trainer", False):  # ours from an earlier call; leave others' handlers alone
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)


def append_metrics(ckpt_dir: Path, record: dict[str, Any]) -> None:
    """One JSON object per line; called by global rank 0 only."""
    record = {**record, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        with (ckpt_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        # Metrics are not worth a crash of rank 0 (which would leave the others waiting); a full disk is
        # reported clearly by the next checkpoint save.
        logging.getLogger(__name__).warning("cannot append to %s: %s", ckpt_dir / METRICS_FILE, e)


# ---------------------------------------------------------------- heartbeat (docs/DESIGN.md §2)

HEARTBEAT_S = 2.0  # at most one write per this many seconds: cheap next to a step, fresh enough for a stall check


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Readers (the orchestrator over SSH) never see half a file. 0644: the orchestrator's login reads it."""
    write_atomic(path, text.encode(), mode=0o644, durable=durable)


def write_json_atomic(path: Path, data: dict[str, Any], durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(data), durable)


class Heartbeat:
    """Global rank 0's progress file, rewritten at most every HEARTBEAT_S seconds: step of total, epoch,
    images/s and ETA over the last window, the slowest step seen (the orchestrator's stall check waits at least
    3x that), the newest checkpoint's step. Other ranks hold a disabled one."""

    def __init__(self, ckpt_dir: Path, enabled: bool, total_steps: int, epochs: int, global_batch: int,
                 speed: Speed | None = None) -> None:
        self.path, self.enabled, self.speed = ckpt_dir / HEARTBEAT_FILE, enabled, speed
        self.rank_fields: dict[str, Any] = {}  # every rank's timings and scores, as of the last agreement
        self.total_steps, self.global_batch = total_steps, global_batch
        self.last_write = self.last_step_end = self.run_start = time.monotonic()
        self.window_steps, self.window_s, self.run_steps = 0, 0.0, 0
        self.slowest_step_s = 0.0
        self.beat = Beat(step=0, state="starting", total_steps=total_steps, epoch=0, epochs=epochs)

    def step_done(self, step: int, epoch: int, loss: float | None) -> None:
        """After every global step. `loss`: the step's loss where rank 0 read it anyway (its step record), else
        None: a beat shows the newest one read and never reads one itself, since that read waits for the device
        (a host sync on rank 0's training thread, which every rank then waits for)."""
        if not self.enabled:
            return
        now = time.monotonic()
        # Kept current on every step, written or not: a phase mark writes them too (else it shows a stale epoch).
        self.beat = replace(self.beat, step=step, epoch=epoch, loss=self.beat.loss if loss is None else loss)
        took = now - self.last_step_end  # this step alone: a phase mark restarts the clock
        self.slowest_step_s = max(self.slowest_step_s, took)
        self.last_step_end = now
        self.window_steps, self.window_s, self.run_steps = self.window_steps + 1, self.window_s + took, \
            self.run_steps + 1
        if now - self.last_write < HEARTBEAT_S:
            return
        # images/s over the steps since the last beat (what the run does now); the ETA from the whole run so far,
        # evaluations and checkpoints included: they are part of the wait, and the long average does not jump.
        run_step_s = (now - self.run_start) / self.run_steps
        images_per_s = self.global_batch * self.window_steps / max(self.window_s, 1e-9)
        mfu = self.speed.mfu(images_per_s) if self.speed else None
        self.beat = replace(self.beat, state="training", images_per_s=images_per_s,
                            eta_s=max(0, self.total_steps - step) * run_step_s,
                            mfu=round(mfu, 4) if mfu is not None else None)
        self.window_steps, self.window_s, self.last_write = 0, 0.0, now
        self._write()

    def ranks(self, rows: list[tuple[float, ...]] | None, ranks_per_node: int,
              stages: tuple[int, ...] | None = None) -> None:
        """Every rank's (step, own work, data wait) seconds per step of the last window (ranktime.RankTimer),
        with the straggler scores and, under --pp, every rank's stage: into the next beat and the step records. Rounded: a 64-rank job's heartbeat
        stays about 2.2 KB."""
        if not self.enabled or rows is None:
            return
        step, work, data = (tuple(float(f"{v:.3g}") for v in col) for col in zip(*rows, strict=True))
        self.rank_fields = {
            "rank_step_s": step, "rank_work_s": work, "rank_data_s": data, "ranks_per_node": ranks_per_node,
            "rank_score": tuple(round(v, 2) for v in straggler_scores(work)),
            "node_score": tuple(round(v, 2) for v in straggler_scores(node_times(work, ranks_per_node))),
            "rank_streak": streaks(self.beat.rank_streak, work)}
        if stages is not None:
            self.rank_fields["rank_stage"] = stages
        self.beat = replace(self.beat, **self.rank_fields)

    def mark(self, state: str, **fields: Any) -> None:
        """A phase without steps (evaluating, checkpointing, done), written at once; the step clock restarts
        after it so a long evaluation is not taken for a slow step."""
        if not self.enabled:
            return
        now = time.monotonic()
        self.beat = replace(self.beat, state=state, **fields)
        if "step" in fields and "eta_s" not in fields and self.run_steps:  # the ETA goes with the step shown
            self.beat = replace(self.beat, eta_s=max(0, self.total_steps - fields["step"]) * (now - self.run_start)
                                / self.run_steps)
        self._write()
        self.last_step_end = time.monotonic()

    def _write(self) -> None:
        beat = replace(self.beat, slowest_step_s=round(self.slowest_step_s, 3), time=time.time())
        try:
            # Atomic (a reader sees a whole beat) but not durable: a beat lost in a power cut is stale anyway,
            # and two fsyncs every HEARTBEAT_S on rank 0's training thread cost every rank 10-100 ms on NFS.
            write_json_atomic(self.path, beat.to_dict(), durable=False)
        except OSError as e:  # progress is not worth a crash of rank 0; the checkpoint save reports a full disk
            logging.getLogger(__name__).warning("cannot write %s: %s", self.path, e)


# ---------------------------------------------------------------- step records and TensorBoard

def open_tensorboard(ckpt_dir: Path, purge_step: int | None) -> Any | None:
    """Global rank 0's TensorBoard writer in $LOG_DIR/tensorboard (CKPT_DIR/tensorboard without a LOG_DIR).
    `purge_step` (a resume): TensorBoard drops the earlier run's events from that step on, as record_resume
    drops its records. None, after one warning, when the tensorboard package is missing (a user's image)."""
    folder = Path(os.environ.get(ENV_LOG_DIR) or ckpt_dir) / TENSORBOARD_FOLDER
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(folder), purge_step=purge_step, flush_secs=10)
    except (ImportError, OSError) as e:
        log.warning("no TensorBoard event files: %s (install the TensorBoard package in the image for them)", e)
        return None


class StepLog:
    """Global rank 0's step records every --log-every steps: a log line, a metrics.jsonl record marked
    "kind": "train_step" (step, epoch, loss, lr, images/s and seconds per step since the previous record, MFU, every
    rank's timings and scores) and the same scalars in TensorBoard."""

    def __init__(self, ckpt_dir: Path, global_batch: int, speed: Speed | None, writer: Any | None) -> None:
        self.ckpt_dir, self.global_batch, self.speed, self.writer = ckpt_dir, global_batch, speed, writer
        self.restart(0)

    def restart(self, step: int) -> None:
        """The clock restarts after a pause that is not steps (an epoch's end, a checkpoint)."""
        self.since, self.since_step = time.perf_counter(), step

    def record(self, step: int, epoch: int, loss: float, lr: float, rank_fields: dict[str, Any]) -> None:
        now = time.perf_counter()
        step_s = (now - self.since) / max(step - self.since_step, 1)
        images_per_s = self.global_batch / max(step_s, 1e-9)
        mfu = self.speed.mfu(images_per_s) if self.speed else None
        log.info("epoch %d step %d loss %.4f lr %.5f images/s %.0f MFU %s", epoch, step, loss, lr, images_per_s,
                 mfu_text(mfu))
        scalars = {"loss": loss, "lr": lr, "images_per_s": images_per_s, "step_s": step_s,
                   **({"mfu": mfu} if mfu is not None else {})}
        append_metrics(self.ckpt_dir, {"kind": STEP_KIND, "step": step, "epoch": epoch, **scalars,
                                       "mfu": mfu, **rank_fields})
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(f"train/{name}", value, step)
        self.restart(step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------- resume records

def is_restart() -> bool:
    """The orchestrator started this run by itself after a failure (a resume, or from the beginning when the
    failure came before the first checkpoint)."""
    return os.environ.get(ENV_RESTART, "").isdigit()


def record_resume(ckpt_dir: Path, step: int, epoch: int, world_size: int, global_batch: int) -> None:
    """On a resume or an automatic restart (global rank 0): drop the records of steps after the checkpoint, or
    all of them on a restart from the beginning (they are trained again, so the curves stay continuous), then
    append one record of the resume itself: `event` "restart" with its number and cause when the orchestrator
    restarted the job by itself, else "resume"."""
    path = ckpt_dir / METRICS_FILE
    try:
        kept = [ln for ln in path.read_text().splitlines() if _step_of(ln) <= step]
    except OSError:
        kept = []
    record: dict[str, Any] = {"event": "restart" if is_restart() else "resume", "step": step, "epoch": epoch,
                              "world_size": world_size, "global_batch": global_batch}
    if is_restart():
        record.update(restart=int(os.environ[ENV_RESTART]), cause=os.environ.get(ENV_RESTART_CAUSE, ""))
    record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        write_text_atomic(path, "".join(f"{ln}\n" for ln in kept) + json.dumps(record) + "\n")
    except OSError as e:
        logging.getLogger(__name__).warning("cannot rewrite %s: %s", path, e)


def _step_of(line: str) -> float:
    """A record's step; a line that is not a record (a torn last line) sorts after every step: dropped."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
