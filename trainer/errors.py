"""Typed exceptions for expected failures; ``__main__`` prints them as one ``error: ...`` line, exit 2."""

from __future__ import annotations


class TrainerError(Exception):
    """An expected failure caused by the input or the environment, not a bug."""


class ConfigError(TrainerError):
    """Options that cannot work together or values out of range."""


class StagesDoNotFit(ConfigError):
    """No split of the model into the pipeline's stages keeps every stage within the device's memory."""

    def __init__(self, need: float, limit: float, stages: int) -> None:
        self.need, self.limit, self.stages = need, limit, stages
        super().__init__(f"--pp: no split into {stages} stages fits the device's memory: the largest stage needs at "
                         f"least {need / 2**30:.2f} GiB (parameters, gradients, momentum and the activations of its "
                         f"micro-batches in flight), the device has {limit / 2**30:.2f} GiB; raise --pp (more stages), "
                         "or make the micro-batches smaller (a smaller --batch-size or more --pp-microbatches)")


class DataError(TrainerError):
    """The data set is missing, corrupt or not the official one."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be written or there is none to resume from."""


class DeviceError(TrainerError):
    """The requested device or precision is not available here."""


class DivergedError(TrainerError):
    """The loss (or the weights) went non-finite: every rank stops at the same step, exit EXIT_DIVERGED."""


def shown(value: object) -> str:
    """A user's value (a path, a name, an argument) as an error line echoes it: control characters escaped
    (a newline in a path would split the one error line; an escape sequence would drive the terminal)."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(value))
