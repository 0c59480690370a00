"""The probe script (orchestrate/remote/scripts/probe.sh) run here under sh, as on a node over SSH."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

from orchestrate.backends.docker_ssh.hostprobe import PROBE_SCRIPT


def probe_facts(data: str, ckpt: str, log: str, *, gpus: bool = False, env: Mapping[str, str] | None = None,
                wrap: Sequence[str] = ()) -> dict[str, str]:
    """The facts the probe prints (name -> value), for these folders, master 127.0.0.1 without its SSH port or the
    listening ports; `gpus`: look for GPUs and RDMA; `wrap`: a command the script runs under (unshare...)."""
    res = subprocess.run([*wrap, "sh", "-c", PROBE_SCRIPT, "probe", data, ckpt, "127.0.0.1", "0", "0",
                          "1" if gpus else "0", log], capture_output=True, timeout=30, env=env)
    assert res.returncode == 0, res.stderr.decode()
    return dict(rec.decode().split("=", 1) for rec in res.stdout.split(b"\0") if b"=" in rec)
