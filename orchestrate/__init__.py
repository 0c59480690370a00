"""The orchestrator: runs the DDP trainer (or any torchrun program) on a cluster over SSH and the Docker SDK
(never imports torch). Python API: `from orchestrate import Job, up, kill, status` (see orchestrate/api.py)."""

__version__ = "0.1.0"

from orchestrate.api import Job, check, kill, logs, plot, status, up  # noqa: E402

__all__ = ["Job", "check", "kill", "logs", "plot", "status", "up", "__version__"]
