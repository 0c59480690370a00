"""Atomic checkpoints with a manifest (docs/DESIGN.md section 2); newest valid one; keep the last K.

A checkpoint counts only when its manifest exists and the .pt's size and sha256 match it.  The .pt is
written to a temporary name, fsynced and renamed; the manifest is written the same way *after* it, so a
kill at any moment leaves either the previous set of valid checkpoints or that set plus the new one.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .atomic import TMP_MARK, is_stale_temp, write_atomic
from .contract import CKPT_NAME_RE, Manifest, manifest_name, pt_name
from .errors import CheckpointError, shown

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _write_atomic(target: Path, blob: bytes | memoryview) -> None:
    """atomic.write_atomic, its failures as CheckpointError saying what to do. 0644: the orchestrator's login
    (another account than the container's) reads the checkpoints to check and copy them."""
    try:
        write_atomic(target, blob, mode=0o644)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise CheckpointError(
                f"checkpoint dir {target.parent} is full (no space left writing {target.name}); free space "
                f"or point --ckpt-dir elsewhere; the previous checkpoints are intact"
            ) from e
        raise CheckpointError(f"cannot write checkpoint {target}: {e.strerror or e}") from e


def check_writable(folder: Path) -> None:
    """Create the folder and prove a file can be written there (call on global rank 0 only)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test{TMP_MARK}{os.getpid()}-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint dir {folder} is not writable ({e.strerror or e}); fix its permissions or choose another --ckpt-dir"
        ) from e


def save(folder: Path, state: dict[str, Any], *, step: int, epoch: int, epoch_complete: bool,
         world_size: int, keep: int) -> Path:
    """Write ckpt-<step>.pt then its manifest, both atomically; prune beyond ``keep``. Global rank 0 only."""
    target = folder / pt_name(step)
    existing = _validate(folder / manifest_name(step), warn=False)
    if existing is not None:
        return existing.path  # the same step is already safely on disk (e.g. SIGTERM right after a save)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getbuffer()
    _write_atomic(target, blob)
    manifest = Manifest(target.name, hashlib.sha256(blob).hexdigest(), len(blob), step, epoch, epoch_complete,
                        world_size, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    _write_atomic(folder / manifest_name(step), json.dumps(manifest.to_dict(), indent=1).encode())
    prune(folder, keep)
    return target


class BackgroundWriter:
    """At most one checkpoint write in flight, in a thread of its own, while training goes on: the write, fsync
    and sha256 of a state already copied off the device. Its outcome is read by `wait` (global rank 0 only)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._step = 0
        self.write_s = 0.0  # how long the last write took, from start to its manifest
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        """A write was started and its outcome not read yet."""
        return self._thread is not None

    @property
    def writing(self) -> bool:
        """The write itself still runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], Path], step: int) -> None:
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is already in flight: wait for it first")  # a bug of the caller
        self._step, self._error = step, None
        # A daemon: a rank that dies of another error exits without waiting (the write is atomic: a cut one is
        # a temp file that the next prune deletes).
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        t0 = time.monotonic()
        try:
            path = write()
            self.write_s = time.monotonic() - t0
            log.info("checkpoint %s written in the background (%.2f s)", path, self.write_s)
        except BaseException as e:  # noqa: BLE001  # handed to the training thread by wait()
            self._error = e

    def wait(self, timeout_s: float) -> int | None:
        """The step of the pending write's checkpoint (None when none was pending), once it is complete; its
        error raised here. A write that outlasts `timeout_s` is a CheckpointError (a stalled disk)."""
        if self._thread is None:
            return None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise CheckpointError(f"the checkpoint of step {self._step} was still being written after {timeout_s:g} s "
                                  "(a stalled disk or network filesystem under --ckpt-dir?); the previous "
                                  "checkpoints are intact")
        self._thread = None
        if self._error is not None:
            raise self._error
        return self._step


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_problem(path: Path, size: int, sha256: str) -> str | None:
    """Why this file is not the one its manifest describes, or None when it is."""
    if not path.is_file():
        return f"{path.name} is missing"
    if path.stat().st_size != size:
        return f"{path.name} has {path.stat().st_size} bytes, manifest says {size} (cut short?)"
    if sha256_file(path) != sha256:
        return f"{path.name} does not match its sha256 (corrupt)"
    return None


def _validate(manifest_path: Path, warn: bool = True) -> CheckpointInfo | None:
    """The checkpoint described by this manifest, or None (with a warning naming it) if it is not valid."""
    if not manifest_path.is_file():
        return None
    why = None
    try:
        m = json.loads(manifest_path.read_text())
        manifest = Manifest.parse(m)
        pt = manifest_path.with_name(manifest.file)
        why = file_problem(pt, manifest.bytes, manifest.sha256)
    except (OSError, ValueError) as e:
        why = f"unreadable manifest ({e})"
    if why is not None:
        if warn:
            log.warning("skipping invalid checkpoint %s: %s", manifest_path, why)
        return None
    return CheckpointInfo(pt, m)


def _steps(folder: Path, suffix: str) -> list[int]:
    steps = []
    for p in folder.iterdir() if folder.is_dir() else []:
        match = CKPT_NAME_RE.fullmatch(p.name)
        if match and match.group(2) == suffix:
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def newest_valid(folder: Path) -> CheckpointInfo | None:
    """The valid checkpoint with the highest step; newer invalid or incomplete ones are skipped with a warning."""
    with_manifest = _steps(folder, "json")  # newest first
    newest: CheckpointInfo | None = None
    for step in with_manifest:
        info = _validate(folder / manifest_name(step))
        if info is not None and (newest is None or info.step > newest.step):
            newest = info
            break
    for step in _steps(folder, "pt"):
        if step not in with_manifest and (newest is None or step > newest.step):
            log.warning("skipping incomplete checkpoint %s: it has no manifest (save cut short?)", folder / pt_name(step))
    return newest


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (manifest first, then the .pt) and stale temp files."""
    for step in _steps(folder, "json")[keep:]:
        (folder / manifest_name(step)).unlink(missing_ok=True)
        (folder / pt_name(step)).unlink(missing_ok=True)
    kept = set(_steps(folder, "json"))
    for step in _steps(folder, "pt"):
        if step not in kept:
            (folder / pt_name(step)).unlink(missing_ok=True)  # orphan of an interrupted save
    for p in folder.iterdir():
        # Temp files of dead writers (only global rank 0 of one job writes here, so none is live).
        if is_stale_temp(p.name):
            p.unlink(missing_ok=True)


def load(info: CheckpointInfo, device: torch.device) -> dict[str, Any]:
    """Load onto this process's own device; plain tensors and containers only (weights_only)."""
    try:
        return torch.load(info.path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:  # the weights-only loader refused an object: not a file this trainer wrote
        raise CheckpointError(f"checkpoint {shown(info.path)} holds objects that are not tensors or plain values "
                              f"({_refusal(e)}); it was not written by this trainer: move it away to resume from "
                              "the one before, or run without --resume") from None
    except Exception as e:  # a file that passed its sha256 but fails to unpickle: report, do not guess
        raise CheckpointError(f"cannot load checkpoint {shown(info.path)}: {_refusal(e)}") from e


def _refusal(err: Exception) -> str:
    """The one line of a loader's message that says what was refused (torch's spans several lines, with advice
    on how to load the file anyway, which is not advice to give about an unknown file)."""
    lines = [line.strip() for line in str(err).split("\n") if line.strip()] or [type(err).__name__]
    # torch names the refused object on a line of its own ("WeightsUnpickler error: ...", or in newer versions
    # "Trying to load unsupported GLOBAL ...").
    reason = next((line for line in lines if "WeightsUnpickler error:" in line or "GLOBAL" in line), lines[0])
    return shown(reason.split("WeightsUnpickler error:")[-1].strip())
