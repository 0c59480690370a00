"""The orchestrator: runs the DDP trainer on a cluster over SSH and the Docker SDK (never imports torch)."""

__version__ = "0.1.0"
