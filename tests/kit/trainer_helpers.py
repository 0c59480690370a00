"""Helpers for the trainer tests: free ports, child environment, running the real trainer under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kit.net import free_port
from trainer import checkpoint
from trainer.config import Config
from trainer.contract import METRICS_FILE, STEP_KIND
from trainer.dist import DistContext

REPO = Path(__file__).resolve().parents[2]
N_TRAIN, N_TEST = 512, 255  # an odd test size: uneven evaluation shards across 2 ranks


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    return env


def base_args(data_dir: Path, ckpt_dir: Path, *extra: str) -> list[str]:
    return ["--data-dir", str(data_dir), "--ckpt-dir", str(ckpt_dir), "--allow-unverified-data",
            "--model", "tiny", "--device", "cpu", "--log-every", "1", *extra]


def torchrun_cmd(nproc: int, args: list[str], entry: tuple[str, ...] = ("-m", "trainer")) -> list[str]:
    """`entry`: what torchrun starts (the trainer module, or a test's wrapper script)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *entry, *args]


def run_torchrun(nproc: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(torchrun_cmd(nproc, args), cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


def newest_state(ckpt_dir: Path) -> dict:
    info = checkpoint.newest_valid(ckpt_dir)
    assert info is not None, f"no valid checkpoint in {ckpt_dir}"
    return checkpoint.load(info, torch.device("cpu"))


def metrics_lines(ckpt_dir: Path) -> list[dict]:
    """The epoch records and resume/restart events; step records (every --log-every steps) are step_lines'."""
    return [r for r in _all_records(ckpt_dir) if r.get("kind") != STEP_KIND]


def step_lines(ckpt_dir: Path) -> list[dict]:
    return [r for r in _all_records(ckpt_dir) if r.get("kind") == STEP_KIND]


def _all_records(ckpt_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt_dir / METRICS_FILE).read_text().splitlines()]


CPU, GPU3 = torch.device("cpu"), torch.device("cuda", 3)  # GPU3: a rank's device, never touched in unit tests


def unit_cfg(**kw: object) -> Config:
    return Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), **kw)  # type: ignore[arg-type]


def unit_ctx(device: torch.device, rank: int = 0, world: int = 1) -> DistContext:
    return DistContext(rank, device.index or 0, world, device)
