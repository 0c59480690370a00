"""Checkpoints by the project's manifest convention (docs/DESIGN.md §2 and §7), and SIGTERM → checkpoint → 143.

Shared by the examples; copy it into your own program. What `up --resume`, `status` and the checkpoint copy
between nodes rely on: in CKPT_DIR, `ckpt-<step:08d>.pt` written first (temp name, fsync, rename), then
`ckpt-<step:08d>.json` = {"format": 1, "file", "sha256", "bytes", "epoch", "step", "epoch_complete",
"world_size", "created"} the same way. A checkpoint counts only when the .pt matches its manifest.
And `exit_without_finalizing`: how a torch program ends without a chance of SIGABRT after its work is done, and
`join_group`: the device and the process group, in the order NCCL needs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch

MANIFEST_RE = re.compile(r"^ckpt-(\d{8})\.json$")
EXIT_STOPPED = 143  # stopped by SIGTERM after writing a checkpoint


def join_group() -> torch.device:
    """cuda:LOCAL_RANK and NCCL when CUDA is visible (NCCL reduces only CUDA tensors, so the model and every
    tensor a collective sees must live there), else the CPU and gloo. set_device comes first: NCCL's
    communicator and every later CUDA call then use this rank's GPU, not cuda:0."""
    if not torch.cuda.is_available():
        torch.distributed.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", device_id=device)
    return device


def exit_without_finalizing(code: int) -> NoReturn:
    """Flush stdout and stderr, then end the process without the interpreter's finalization.

    torch's C++ threads (gloo's) outlive destroy_process_group; one that takes the GIL while the interpreter
    finalizes is ended through a noexcept frame and the rank aborts ("terminate called without an active
    exception") after a successful run (pytorch/pytorch#38230, #179291). Close your files before."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StopFlag:
    """Set by SIGTERM; the training loop checks it between steps (a handler must not write files)."""

    def __init__(self) -> None:
        self.set = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.set = True


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from the orchestrator's login (it checks the sha256)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(ckpt_dir: str, state: dict[str, Any], step: int, epoch: int, epoch_complete: bool, world_size: int) -> Path:
    """The .pt first, then its manifest: a crash in between leaves no manifest, so no half checkpoint counts."""
    folder = Path(ckpt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pt = folder / f"ckpt-{step:08d}.pt"
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(pt, data)
    manifest = {"format": 1, "file": pt.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "epoch": epoch, "step": step, "epoch_complete": epoch_complete, "world_size": world_size,
                "created": datetime.now(timezone.utc).isoformat()}
    _atomic_write(folder / f"ckpt-{step:08d}.json", json.dumps(manifest).encode())
    return pt


def load_newest(ckpt_dir: str) -> dict[str, Any] | None:
    """The newest checkpoint whose .pt matches its manifest (size and sha256), or None."""
    folder = Path(ckpt_dir)
    names = sorted((p.name for p in folder.glob("ckpt-*.json") if MANIFEST_RE.match(p.name)), reverse=True)
    for name in names:
        try:
            manifest = json.loads((folder / name).read_text())
            data = (folder / Path(manifest["file"]).name).read_bytes()
        except (OSError, ValueError, KeyError):
            continue
        if len(data) == manifest["bytes"] and hashlib.sha256(data).hexdigest() == manifest["sha256"]:
            return dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=False))
    return None
