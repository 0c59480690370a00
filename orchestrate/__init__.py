"""The orchestrator: runs the DDP trainer (or any torchrun program) on a cluster over SSH and the Docker SDK
(never imports torch). Python API: `from orchestrate import Job, up, kill, status` (see orchestrate/api.py).

The API is imported on first use (PEP 562), so that importing a lower layer alone, such as the pure plan
(`orchestrate.plan`), does not load SSH and Docker through this package's own import."""

from typing import Any

from orchestrate.version import __version__

__all__ = ["Job", "check", "kill", "logs", "plot", "status", "up", "__version__"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from orchestrate import api

        return getattr(api, name)
    raise AttributeError(f"module 'orchestrate' has no attribute {name!r}")
