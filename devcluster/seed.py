"""Hosts that start with images already loaded, as hosts provisioned with them: `Cluster.create(images=...)`.

Loading the CPU image (0.9 GB, ~18k files) into a new host's dockerd took 27 s alone on this 2-core machine, and
a cluster pays it once per host (2-3 times that under the test suite's load). So it is paid once: a seed is
the `image/` and `overlay2/` folders of a dockerd that loaded the images (a 1-host cluster, then stopped), kept
in `<root>/.seeds/<key>/`, the key made of the images' IDs (a rebuilt image makes a new seed). A new host's data
root gets hard links to the seed's files before its dockerd starts (0.6 s for the CPU image): folders are the
host's own, so what its dockerd adds or removes stays its own. dockerd never writes an image layer's files in
place: overlayfs writes to the container's upper folder, and the image and layer metadata are written whole
(a new file renamed over the old), which replaces this host's link and leaves the seed as it was. The one file
it does rewrite in place, a layer's `committed` mark, is copied to each host (OWN_COPIES). The Bolt
databases that are written in place (buildkit/, network/, volumes/) are not part of a seed.

The orchestrator then finds the image on the host ("already there, nothing sent"), exactly as on a host where
someone loaded it by hand; tests of the image transfer itself use hosts without a seed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, contextmanager
from hashlib import sha256
from pathlib import Path
from typing import Any

import docker
import docker.errors

from .errors import DevclusterError
from .layout import HostLayout, state_root

log = logging.getLogger(__name__)

SEEDS = ".seeds"
PARTS = ("image", "overlay2")  # what a seed holds of a data root: the images, nothing written in place
KEEP = 3  # seeds kept (newest used first): one per image build that parallel work trees test
LOAD_TIMEOUT_S = 900.0
MARK = "complete"
# Files dockerd rewrites in place (truncating, not renaming over): overlay2 writes a layer's empty `committed` mark
# each time it makes the layer's diff (a `docker push` from a seeded host did; seen as the seed's mark getting a new
# mtime while another test held that seed's listing). A host gets a copy of its own of each, not a link.
OWN_COPIES = ("overlay2/*/committed",)


def seeds_dir() -> Path:
    return state_root() / SEEDS


def key_of(images: Sequence[str]) -> str:
    """The seed's name: a hash of the images' IDs in the local dockerd (DevclusterError names a missing one)."""
    ids = []
    with closing(docker.from_env(timeout=60)) as client:
        for tag in images:
            try:
                ids.append(str(client.images.get(tag).id))
            except docker.errors.ImageNotFound:
                raise DevclusterError(f"image {tag} is not in the local dockerd: build or load it first") from None
    return sha256("\n".join(sorted(set(ids))).encode()).hexdigest()[:16]


@contextmanager
def _locked() -> Iterator[None]:
    """One seed made at a time on this machine (the test workers start their clusters at the same moment)."""
    seeds_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(seeds_dir() / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ensure(images: Sequence[str], one_host: Callable[[], AbstractContextManager[Any]]) -> Path:
    """The seed folder of these local images, made first when missing, in a cluster of one host that `one_host`
    brings up (cluster.py passes its own; taking it as an argument keeps seed.py below cluster.py)."""
    key = key_of(images)
    seed = seeds_dir() / key
    with _locked():
        if not (seed / MARK).is_file():
            _make(images, seed, one_host)
        os.utime(seed / MARK)  # newest used: kept by _prune
        _prune(keep=seed)
    return seed


def _make(images: Sequence[str], seed: Path, one_host: Callable[[], AbstractContextManager[Any]]) -> None:
    t0 = time.monotonic()
    shutil.rmtree(seed, ignore_errors=True)  # an unfinished one (no mark) from a killed run
    with one_host() as loader:
        host = loader.hosts[0]
        _load(images, host.layout)
        host.stop_docker()
        partial = seed.with_name(seed.name + ".part")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(mode=0o700)
        for part in PARTS:
            os.rename(host.layout.data_root / part, partial / part)
        (partial / MARK).write_text("\n".join(images) + "\n")
        os.rename(partial, seed)
    log.info("seed %s of %s made in %.1f s", seed.name, ", ".join(images), time.monotonic() - t0)


def _load(images: Sequence[str], host: HostLayout) -> None:
    """`docker save` from the local dockerd straight into the host's own socket: no SSH, no compression."""
    save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
    try:
        load = subprocess.run(["docker", "-H", f"unix://{host.docker_sock}", "load", "-q"], stdin=save.stdout,
                              capture_output=True, text=True, timeout=LOAD_TIMEOUT_S, check=False)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        saved = save.wait(timeout=LOAD_TIMEOUT_S)
    if saved != 0 or load.returncode != 0:
        raise DevclusterError(f"loading {', '.join(images)} into a seed host failed: {load.stderr.strip()}")


def plant(seed: Path, host: HostLayout) -> None:
    """Before the host's dockerd first starts: its data root gets hard links to the seed's files, and copies of
    its own of the layers' `committed` marks (OWN_COPIES)."""
    host.data_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for part in PARTS:
        subprocess.run(["cp", "-a", "--link", str(seed / part), str(host.data_root)], check=True, timeout=300,
                       capture_output=True)
    for pattern in OWN_COPIES:
        for linked in host.data_root.glob(pattern):
            own = linked.with_name(linked.name + ".own")
            shutil.copy2(linked, own)
            os.replace(own, linked)


def _prune(keep: Path) -> None:
    """Keep the KEEP seeds used last (each holds an image's files); the rest is deleted."""
    done = sorted((d for d in seeds_dir().iterdir() if (d / MARK).is_file()),
                  key=lambda d: (d / MARK).stat().st_mtime, reverse=True)
    for old in done[KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
