"""Image check: can this image run this entry under torchrun? One short container on node 0, before any start.

The image may be any image with Python and torch (the project's, one built FROM it, an NGC release): the
check asks it for torch's version (from package metadata: importing torch costs seconds), for torchrun on
PATH (else `python -m torch.distributed.run` launches), whether the image has `trainer.launch` (the project's start
of one process a node without torchrun's agent: in the project's image and those built FROM it), and whether the
entry is there (a module that `importlib.util.find_spec` finds, or a script file, relative to the image's working
directory).
An image ID names its content, so a check that passed is remembered by (image ID, entry) in
$XDG_CACHE_HOME/ddp-cifar/image-checks and not run again (0.4 s of every `up` of an unchanged image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrate.config import Program
from orchestrate.errors import PreflightError
from orchestrate.localfs import cache_root, write_atomically
from orchestrate.probe.observations import TORCHRUN, Launcher
from orchestrate.remote import scripts

ONE_PROCESS_MODULE = "trainer.launch"
MEMO_VERSION = "2"  # raised whenever check_image.py answers a new question
# sh finds a Python (python or python3), then check_image.py answers in one JSON line.
FIND_PYTHON = scripts.text("find_python.sh")
CHECK_IMAGE = scripts.text("check_image.py")


@dataclass(frozen=True)
class ImageFacts:
    python: str | None
    torch: str | None
    torchrun: str | None
    entry: bool
    entry_error: str | None = None
    one_process: bool = False  # the image has trainer.launch


def parse_facts(output: str) -> ImageFacts:
    """PURE: the check's last output line → facts (a missing or garbled line is 'no python')."""
    lines = [ln for ln in output.strip().splitlines() if ln.startswith("{")]
    try:
        data = json.loads(lines[-1]) if lines else {}
    except ValueError:
        data = {}
    return ImageFacts(python=data.get("python"), torch=data.get("torch"), torchrun=data.get("torchrun"),
                      entry=bool(data.get("entry")), entry_error=data.get("entry_error"),
                      one_process=bool(data.get("one_process")))


def judge(facts: ImageFacts, program: Program) -> Launcher:
    """PURE: the launchers the image has (torchrun, or python -m torch.distributed.run; trainer.launch where it is
    there); PreflightError when unusable."""
    kind, target = program.entry_target
    where = f"image {program.image}"
    if facts.python is None:
        problem = "has no python (python or python3 on PATH); use an image with Python and torch"
    elif facts.torch is None:
        problem = "has no torch; use an image with torch, e.g. one built FROM the project's image"
    elif not facts.entry:
        what = f"module {target!r} is not importable" if kind == "module" else f"script {target!r} is not a file"
        why = f" ({facts.entry_error})" if facts.entry_error else ""
        problem = f"lacks the entry: {what}{why}; check --entry, or add it to the image"
    else:
        torchrun = TORCHRUN if facts.torchrun else (facts.python, "-m", "torch.distributed.run")
        return Launcher(torchrun, (facts.python, "-m", ONE_PROCESS_MODULE) if facts.one_process else None)
    raise PreflightError(f"preflight failed, nothing was started: {where} {problem}")


def check_image(program: Program, image_id: str | None, run: Callable[[], str]) -> Launcher:
    """The launchers of this image and entry: remembered, or judged from the output of the check `run` gives
    (the scheduler runs the plan's image check container: `Scheduler.image_check`). `image_id`: the image's ID where
    known (None: check every time)."""
    memo = _memo_path(image_id, program.entry_target) if image_id else None
    remembered = _recall(memo) if memo else None
    if remembered is not None:
        return judge(remembered, program)
    facts = parse_facts(run())
    launcher = judge(facts, program)
    if memo:  # only a check that passed: a refused image is checked again after the user's fix
        with contextlib.suppress(OSError):  # a cache that cannot be written (full, read-only) costs 0.4 s, no more
            write_atomically(memo, [json.dumps(dataclasses.asdict(facts)).encode()])
    return launcher


def _memo_path(image_id: str, target: tuple[str, str]) -> Path:
    """The memo of (the check's questions, image ID, entry): a check that asks more than an older one answered (as
    `one_process` since trainer.launch) is not answered by that one's memo."""
    key = hashlib.sha256("\0".join((MEMO_VERSION, image_id, *target)).encode()).hexdigest()[:32]
    return cache_root() / "image-checks" / f"{key}.json"


def _recall(path: Path) -> ImageFacts | None:
    """A remembered check; None when there is none or it is damaged (then the check runs again)."""
    try:
        facts = parse_facts(path.read_text())
    except OSError:
        return None
    return facts if facts.python and facts.torch and facts.entry else None  # only passed checks are written
