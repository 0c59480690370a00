"""Image check: can this image run this entry under torchrun? One short container on node 0, before any start.

The image may be any image with Python and torch (the project's, one built FROM it, an NGC release): the
check asks it for torch's version (from package metadata: importing torch costs seconds), for torchrun on
PATH (else `python -m torch.distributed.run` launches), and whether the entry is there (a module that
`importlib.util.find_spec` finds, or a script file, relative to the image's working directory).
An image ID names its content, so a check that passed is remembered by (image ID, entry) in
$XDG_CACHE_HOME/ddp-cifar/image-checks and not run again (0.4 s of every `up` of an unchanged image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.config import UpConfig
from orchestrate.errors import PreflightError
from orchestrate.jobs.memory import cache_root, write_atomically
from orchestrate.remote import scripts
from orchestrate.remote.docker import client_over_ssh
from orchestrate.remote.ssh import Connection

TORCHRUN = ("torchrun",)
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


def entry_target(config: UpConfig) -> tuple[str, str]:
    """("module", "pkg.mod") or ("script", "/path/x.py")."""
    argv = config.entry_argv
    return ("module", argv[1]) if argv[0] == "-m" else ("script", argv[0])


def parse_facts(output: str) -> ImageFacts:
    """PURE: the check's last output line → facts (a missing or garbled line is 'no python')."""
    lines = [ln for ln in output.strip().splitlines() if ln.startswith("{")]
    try:
        data = json.loads(lines[-1]) if lines else {}
    except ValueError:
        data = {}
    return ImageFacts(python=data.get("python"), torch=data.get("torch"), torchrun=data.get("torchrun"),
                      entry=bool(data.get("entry")), entry_error=data.get("entry_error"))


def judge(facts: ImageFacts, config: UpConfig) -> tuple[str, ...]:
    """PURE: the launcher to use (torchrun, or python -m torch.distributed.run); PreflightError when unusable."""
    kind, target = entry_target(config)
    where = f"image {config.image}"
    if facts.python is None:
        problem = "has no python (python or python3 on PATH); use an image with Python and torch"
    elif facts.torch is None:
        problem = "has no torch; use an image with torch, e.g. one built FROM the project's image"
    elif not facts.entry:
        what = f"module {target!r} is not importable" if kind == "module" else f"script {target!r} is not a file"
        why = f" ({facts.entry_error})" if facts.entry_error else ""
        problem = f"lacks the entry: {what}{why}; check --entry, or add it to the image"
    else:
        return TORCHRUN if facts.torchrun else (facts.python, "-m", "torch.distributed.run")
    raise PreflightError(f"preflight failed, nothing was started: {where} {problem}")


def check_image(conn: Connection, config: UpConfig, image_id: str | None, here: Any = None) -> tuple[str, ...]:
    """The launcher argv for this image and entry: remembered, or from the check run in one short container
    (no network, removed after). `image_id`: the image's ID where known (None: check every time).

    The container runs on node 0 over `conn`, with a client of its own, closed at once: its channels must not add
    to the job's on a host with OpenSSH's stock MaxSessions (10 channels per connection). `here`: the local
    daemon's client instead, for an image that node 0 gets from here (the same ID: the same files), so that the
    plan knows the launcher before anything is sent."""
    memo = _memo_path(image_id, entry_target(config)) if image_id else None
    remembered = _recall(memo) if memo else None
    if remembered is not None:
        return judge(remembered, config)
    client = here if here is not None else client_over_ssh(conn, timeout=120)
    try:
        facts = parse_facts(_run_check(client, config))
    finally:
        if here is None:
            client.close()
    launcher = judge(facts, config)
    if memo:  # only a check that passed: a refused image is checked again after the user's fix
        with contextlib.suppress(OSError):  # a cache that cannot be written (full, read-only) costs 0.4 s, no more
            write_atomically(memo, [json.dumps(dataclasses.asdict(facts)).encode()])
    return launcher


def _memo_path(image_id: str, target: tuple[str, str]) -> Path:
    key = hashlib.sha256("\0".join((image_id, *target)).encode()).hexdigest()[:32]
    return cache_root() / "image-checks" / f"{key}.json"


def _recall(path: Path) -> ImageFacts | None:
    """A remembered check; None when there is none or it is damaged (then the check runs again)."""
    try:
        facts = parse_facts(path.read_text())
    except OSError:
        return None
    return facts if facts.python and facts.torch and facts.entry else None  # only passed checks are written


def _run_check(client: Any, config: UpConfig) -> str:
    import docker.errors

    kind, target = entry_target(config)
    try:
        out = client.containers.run(config.image, command=[kind, target], entrypoint=["sh", "-c", FIND_PYTHON, "check", CHECK_IMAGE],
                                    network_mode="none", remove=True, stdout=True, stderr=True)
    except docker.errors.ContainerError as err:
        stderr = err.stderr.decode(errors="replace").strip() if isinstance(err.stderr, bytes) else ""
        raise PreflightError(f"preflight failed, nothing was started: image {config.image}: the check "
                             f"container failed ({stderr[-200:] or err.exit_status}); does it have sh?") from None
    except docker.errors.APIError as err:
        raise PreflightError(f"preflight failed, nothing was started: image {config.image} cannot run "
                             f"({err.explanation or err}); does it have sh?") from None
    return str(out.decode(errors="replace"))
