"""Simulated hosts for tests and the demo: per host a netns, its own sshd and its own dockerd."""

from .cluster import Cluster, Host
from .errors import DevclusterError

__all__ = ["Cluster", "DevclusterError", "Host"]
