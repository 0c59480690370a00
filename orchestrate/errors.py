"""Typed exceptions for expected failures. The CLI prints each as one line (or one line per host)."""

from __future__ import annotations

from collections.abc import Mapping


class OrchestrateError(Exception):
    """An expected failure: the message names the thing and says what to do."""

    exit_code = 2

    def lines(self) -> list[str]:
        return [str(self)]


class ConfigError(OrchestrateError):
    """Bad command-line input."""


class HostsFileError(OrchestrateError):
    """A hosts file or ssh config problem; the message names file and line."""


class SSHError(OrchestrateError):
    """A host could not be reached or a command on it failed."""

    exit_code = 1


class HostKeyError(SSHError):
    """A host key is unknown or changed."""


class PreflightError(OrchestrateError):
    """A host is not fit to run the job; nothing was started."""

    exit_code = 1


class JobError(OrchestrateError):
    """The job failed, or a job operation could not complete."""

    exit_code = 1


class NoCheckpointError(JobError):
    """--resume (or an automatic restart) found no valid checkpoint of the job on any node."""


class MultiHostError(OrchestrateError):
    """Failures on several hosts, collected from a parallel fan-out: one line per host."""

    exit_code = 1

    def __init__(self, what: str, failures: Mapping[str, BaseException | str]) -> None:
        self.what = what
        self.failures = dict(failures)
        super().__init__(f"{what} failed on {len(self.failures)} host(s): " + "; ".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{host}: {_one_line(err)}" for host, err in sorted(self.failures.items())]


def _one_line(err: BaseException | str) -> str:
    text = str(err) or type(err).__name__
    return " ".join(text.split())
