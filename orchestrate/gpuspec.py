"""`--gpus` as written: a count, 'all', or device indices (0,1,2,3 or 4-7); parsed once into what the plan reads."""

from __future__ import annotations

import re
from collections.abc import Sequence

from orchestrate.errors import ConfigError

GPUS_ALL = -1
MAX_GPU_INDEX = 1023  # as MAX_SLOTS: an index above is a typo, not a machine
_HELP = "give a number of GPUs per node, 'all', device indices (0,1,2,3 or 4-7), or 0 for CPU"
_ITEM_RE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")


def parse_gpus(text: str) -> int | tuple[int, ...]:
    """`--gpus` as given: GPUS_ALL, a count, or the device indices in the order written. A single number is a
    count (Docker's meaning); indices need a comma or a range, so `--gpus 3` stays three GPUs."""
    text = text.strip()
    if text == "all":
        return GPUS_ALL
    if re.fullmatch(r"-?[0-9]+", text):
        value = int(text)
        if value < 0:
            raise ConfigError(f"--gpus {value} is negative; {_HELP}")
        return value
    indices: list[int] = []
    for item in text.split(","):
        found = _ITEM_RE.fullmatch(item.strip())
        if not found:
            raise ConfigError(f"--gpus {text!r}: {_HELP}")
        first, last = int(found.group(1)), int(found.group(2) or found.group(1))
        if last < first or last > MAX_GPU_INDEX:
            raise ConfigError(f"--gpus {text!r}: range {item.strip()} is empty or above {MAX_GPU_INDEX}; "
                              "write it low-high, e.g. 4-7")
        indices += range(first, last + 1)
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if repeated:
        raise ConfigError(f"--gpus {text!r}: GPU {', '.join(map(str, repeated))} listed twice; "
                          "give each device index once")
    return tuple(indices)


def split(value: int | Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(count, device indices) of a parsed `--gpus`: a count has no indices; indices count themselves."""
    if isinstance(value, int):
        return value, ()
    return len(value), tuple(value)
