"""A cluster made by a child process that the test then SIGKILLs: what a killed test run leaves for `gc`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from devcluster import Cluster
from kit.lines import LineReader

REPO = Path(__file__).resolve().parents[2]


def cluster_of_a_child(create_args: str) -> tuple[subprocess.Popen[str], Cluster]:
    """A child runs `Cluster.create(<create_args>)` and sleeps; (the child, the cluster as loaded here)."""
    code = (f"import time; from devcluster import Cluster; c = Cluster.create({create_args}); "
            "print(c.name, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        name = LineReader(proc.stdout).next(120, "the child's cluster name").strip()
        assert name, "the child did not make a cluster"
        return proc, Cluster.load(name)
    except BaseException:
        proc.kill()
        raise
