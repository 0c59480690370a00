"""Typed errors of devcluster: each one reads as a single line naming the thing and what to do."""

from __future__ import annotations


class DevclusterError(Exception):
    """An expected failure: the CLI prints it as one line and exits non-zero."""


class NotRootError(DevclusterError):
    """devcluster needs root (network namespaces, bridges, iptables, dockerd)."""


class ToolMissingError(DevclusterError):
    """A program devcluster drives (ip, sshd, dockerd, ...) is not installed."""


class CommandError(DevclusterError):
    """A command failed or ran past its time limit."""


class StartError(DevclusterError):
    """A host's daemon did not come up within its time limit."""


class NoSubnetError(DevclusterError):
    """Every candidate /24 is already used by a route, an address or another cluster."""


class UnknownClusterError(DevclusterError):
    """No state folder for the named cluster."""
