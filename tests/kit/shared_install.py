"""The orchestrator installed where every test host sees it, as a site installs it on shared storage.

A batch job runs on a test host in that host's mount namespace, where /tmp, /root, /home, /var/tmp, /mnt and /run
are the host's own (devcluster/hostfs.py). A checkout or a venv under one of them (a fresh clone in `mktemp -d`, the
venv's Python under /root/.pyenv) is not there. So the test copies the orchestrator's packages and the
distributions they need (what `pip install` would put into a site's shared software folder) into a folder under
the cluster's, which every host sees at the same path, and the batch job runs the system's python3 on it.
"""

from __future__ import annotations

import re
import shutil
from importlib import metadata
from pathlib import Path

# The orchestrator's own packages: orchestrate/ with its scripts, and the trainer's stdlib contract it reads.
PACKAGES = ("orchestrate", "trainer")
REQUIREMENT_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _needed(roots: tuple[str, ...]) -> list[metadata.Distribution]:
    """The distributions `roots` need at run time, recursively (markers of extras left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another Python version or platform
        seen[name] = dist
        for req in dist.requires or []:
            if "extra ==" not in req and (match := REQUIREMENT_NAME.match(req)):
                todo.append(match.group(0))
    return list(seen.values())


def pythonpath(dest: Path) -> str:
    """The PYTHONPATH that runs the orchestrator installed into `dest`."""
    return f"{dest / 'src'}:{dest / 'site-packages'}"


def install(repo: Path, dest: Path, roots: tuple[str, ...] = ("docker", "paramiko", "rich")) -> None:
    """Copy the orchestrator and the distributions it needs into `dest` (see pythonpath)."""
    src, site = dest / "src", dest / "site-packages"
    for package in PACKAGES:
        shutil.copytree(repo / package, src / package, ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
    for dist in _needed(roots):
        base = Path(str(dist.locate_file("")))
        for file in dist.files or []:
            path = base / file
            if path.is_file() and not str(file).startswith(".."):
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, site / file)
