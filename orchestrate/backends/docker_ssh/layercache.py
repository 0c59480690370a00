"""The local layer cache: `docker push` into a registry on loopback, so that a new image costs only its new layers.

Why: the Engine API's only export, `docker save`, writes the whole image (912 MB for the CPU image, many GB on
NGC's base) even when every node lacks one 30 KB layer, so it was the floor of a delivery after a code change.
`docker push` compresses and uploads only the layers the registry lacks (the daemon remembers the blob of every
layer it pushed and checks that the registry still has it), so after a `trainer/` change the cache gains one
small blob in a fraction of a second. A cached blob is a gzip-compressed layer tar, and `docker load` takes a
compressed layer.tar as it is (it decompresses and checks the diff ID), so a node's archive is made of cached
blobs with nothing to compress here: `archive` writes manifest.json, the image config and the blobs of the
layers the node lacks (FIELD-NOTES: `docker load` never opens the layer files of layers it holds).

The registry is Debian's `docker-registry` (distribution 2.8), started for one delivery on a free loopback port
and stopped after it; its storage, $XDG_CACHE_HOME/ddp-cifar/layers, persists between runs. dockerd pushes to a
127.0.0.0/8 registry over plain HTTP without configuration. Concurrent `up`s each start their own registry on
the same storage, which distribution supports (uploads are private until an atomic rename); their pushes take
turns (a lock file), so that two `up`s of a new base compress it once, not twice at the same time. Deleting the
folder is safe: the next push uploads what is missing again.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from orchestrate.config import Delivery
from orchestrate.errors import ConfigError, OrchestrateError
from orchestrate.localfs import cache_root, end_child

log = logging.getLogger(__name__)
REGISTRY_BINARY = "docker-registry"
REPOSITORY = "ddp-cifar-layers"  # every image in one repository: a layer shared by two images is stored once
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
START_TIMEOUT_S = 20.0
PORT_ATTEMPTS = 3
CHUNK = 1 << 20
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long a push waits for another `up`'s push into the same cache: a first fill with NGC's base compresses
# about 20 GB. Past it the push fails (auto: `docker save` is used instead).
FILL_WAIT_S = 1800.0
LOCK_POLL_S = 0.5


class LayerCacheError(OrchestrateError):
    """The local layer cache could not be started or filled (the caller then uses `docker save`)."""

    exit_code = 1


def cache_dir() -> Path:
    return cache_root() / "layers"


def registry_binary() -> str | None:
    return shutil.which(REGISTRY_BINARY)


def require_registry(delivery: Delivery) -> None:
    """`--layer-cache on` (the image not pulled): refused here, before any host, when the registry is not installed."""
    if delivery.layer_cache == "on" and not delivery.pull and registry_binary() is None:
        raise ConfigError(f"--layer-cache on: {REGISTRY_BINARY} is not installed here; install it (Debian: apt-get "
                          "install docker-registry) or use --layer-cache auto")


@dataclass(frozen=True)
class Blob:
    digest: str  # sha256:... of the compressed layer
    size: int


@dataclass(frozen=True)
class CachedImage:
    """An image as the cache holds it: its config (whose sha256 is the image ID) and its layer blobs in order."""

    config: bytes
    layers: tuple[Blob, ...]

    @property
    def total(self) -> int:
        """The whole image compressed: what a node that holds none of its layers receives."""
        return len(self.config) + sum(b.size for b in self.layers)


# ---- pure: the archive `docker load` takes ----------------------------------------------------------------


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(tarfile.GNU_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def layer_path(blob: Blob) -> str:
    return f"{blob.digest.split(':', 1)[1]}/layer.tar"


def archive(image: CachedImage, name: str | None, keep_from: int,
            blob_chunks: Callable[[Blob], Iterator[bytes]]) -> Iterator[bytes]:
    """A `docker load` archive of `image` holding only layers keep_from.. (the node holds the ones before).

    manifest.json lists every layer (load needs the whole chain to name it); `name` becomes the loaded tag.
    """
    config_name = hashlib.sha256(image.config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name] if name else [],
                            "Layers": [layer_path(b) for b in image.layers]}]).encode()
    for entry, data in (("manifest.json", manifest), (config_name, image.config)):
        yield _header(entry, len(data)) + data + _padding(len(data))
    for blob in image.layers[keep_from:]:
        yield _header(layer_path(blob), blob.size)
        got = 0
        for chunk in blob_chunks(blob):
            got += len(chunk)
            yield chunk
        if got != blob.size:
            raise LayerCacheError(f"layer cache: blob {blob.digest[:19]} has {got} bytes, its manifest says "
                                  f"{blob.size}; delete {cache_dir()} and run again")
        yield _padding(blob.size)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def parse_manifest(raw: bytes, image_id: str, layers: int) -> tuple[str, tuple[Blob, ...]]:
    """The config digest and layer blobs of a schema-2 manifest, checked against the image pushed."""
    try:
        doc = json.loads(raw)
        config = str(doc["config"]["digest"])
        blobs = tuple(Blob(str(b["digest"]), int(b["size"])) for b in doc["layers"])
    except (ValueError, KeyError, TypeError) as err:
        raise LayerCacheError(f"layer cache: unreadable manifest ({err})") from None
    if config != image_id or len(blobs) != layers:
        raise LayerCacheError(f"layer cache: the manifest names config {config[:19]} with {len(blobs)} layers, the "
                              f"image is {image_id[:19]} with {layers}")
    return config, blobs


# ---- the registry process ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, port: int) -> str:
    return (f"version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {json.dumps(str(root))}\n"
            f"http:\n  addr: 127.0.0.1:{port}\n")


class LayerCache:
    """A running registry on 127.0.0.1:port over the cache folder (use `started`)."""

    def __init__(self, port: int, root: Path) -> None:
        self.port = port
        self.root = root
        self.base = f"http://127.0.0.1:{port}/v2/{REPOSITORY}"

    @classmethod
    @contextmanager
    def started(cls, binary: str, root: Path) -> Iterator[LayerCache]:
        """Start the registry (another free port if the one picked is taken meanwhile); stop it on exit."""
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="registry-", dir=root.parent) as tmp:
            proc, port = cls._start(binary, root, Path(tmp))
            try:
                yield cls(port, root)
            finally:
                end_child(proc)

    @staticmethod
    def _start(binary: str, root: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
        why = ""
        for attempt in range(PORT_ATTEMPTS):
            port = _free_port()
            config, errors = tmp / f"config{attempt}.yml", tmp / f"stderr{attempt}"
            config.write_text(_config(root, port))
            with errors.open("wb") as err:
                proc = subprocess.Popen([binary, "serve", str(config)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_die_with_parent)
            if _answers(proc, port):
                return proc, port
            ended = proc.poll()
            proc.kill()
            proc.wait(timeout=10)
            lines = errors.read_text(errors="replace").strip().splitlines()
            why = lines[-1] if lines else (f"exit code {ended}" if ended is not None else
                                           f"no answer on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s")
        raise LayerCacheError(f"layer cache: {binary} did not start: {why}")

    # ---- filling and reading ----

    def put(self, local: Any, image_id: str, layers: int, progress: Callable[[dict[str, Any]], None]) -> CachedImage:
        """Push the local image (only the layers the cache lacks move) and return it as cached."""
        ref, tag = f"127.0.0.1:{self.port}/{REPOSITORY}", image_id.split(":", 1)[1]
        local.api.tag(image_id, ref, tag)
        try:
            with one_filler(self.root, FILL_WAIT_S):
                for event in local.api.push(ref, tag=tag, stream=True, decode=True):
                    if isinstance(event, dict) and event.get("error"):
                        raise LayerCacheError(f"layer cache: docker push: {event['error']}")
                    progress(event)
        finally:
            local.api.remove_image(f"{ref}:{tag}")  # the temporary tag only; the image keeps its own names
        raw = self._get(f"{self.base}/manifests/{tag}", {"Accept": MANIFEST_V2})
        config_digest, blobs = parse_manifest(raw, image_id, layers)
        config = self._get(f"{self.base}/blobs/{config_digest}")
        if "sha256:" + hashlib.sha256(config).hexdigest() != image_id:
            raise LayerCacheError(f"layer cache: the config of {image_id[:19]} does not match its digest")
        return CachedImage(config, blobs)

    def blob_chunks(self, blob: Blob) -> Iterator[bytes]:
        try:
            with urllib.request.urlopen(f"{self.base}/blobs/{blob.digest}", timeout=60) as res:
                while chunk := res.read(CHUNK):
                    yield chunk
        except (urllib.error.URLError, OSError) as err:
            raise LayerCacheError(f"layer cache: reading blob {blob.digest[:19]}: {err}") from None

    def _get(self, url: str, headers: dict[str, str] | None = None) -> bytes:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as res:
                return bytes(res.read())
        except (urllib.error.URLError, OSError) as err:
            raise LayerCacheError(f"layer cache: GET {url}: {err}") from None


@contextmanager
def one_filler(root: Path, wait_s: float) -> Iterator[None]:
    """Hold the cache's fill lock (flock: released by the kernel when its holder dies, even by SIGKILL)."""
    with (root / ".fill.lock").open("a") as lock:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LayerCacheError(f"layer cache: another `up` has been filling {root} for more than "
                                          f"{wait_s:.0f} s") from None
                if not told:
                    log.warning("layer cache: another `up` is filling it; waiting for its layers (at most %.0f s)",
                                wait_s)
                    told = True
                time.sleep(LOCK_POLL_S)  # flock has no timeout of its own: poll, bounded by the deadline
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the thread that started it ends, even when `up` is killed
    with SIGKILL, so no registry is left holding a port. Elsewhere nothing: `started` still stops it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _answers(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Wait until the registry serves /v2/ (True) or its process ends (False), at most START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as res:
                if res.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)  # polling a port that is not open yet: there is no event to wait on
    return False


# ---- the cache as a delivery uses it: opened per --layer-cache, filled with a progress bar -------------------


class _Pushed:
    """`docker push` progress as one bar (bytes of the layers being compressed and stored) and a count of the
    layers the cache gained."""

    def __init__(self, bars: Progress, name: str) -> None:
        self.bars, self.task = bars, bars.add_task(f"image {name} -> local layer cache", total=None)
        self.layers: dict[str, tuple[int, int]] = {}
        self.new = 0

    def __call__(self, event: dict[str, Any]) -> None:
        detail, layer = event.get("progressDetail") or {}, str(event.get("id", ""))
        if event.get("status") == "Pushed":
            self.new += 1
        if detail.get("total"):
            self.layers[layer] = (int(detail.get("current", 0)), int(detail["total"]))
            self.bars.update(self.task, completed=sum(c for c, _ in self.layers.values()),
                             total=sum(t for _, t in self.layers.values()))


def _cache_failed(err: LayerCacheError, mode: str, name: str, console: Console) -> None:
    if mode == "on":
        raise err
    console.print(f"image {name}: {err}; sending from docker save instead", markup=False, highlight=False)


def open_cache(mode: str, name: str, console: Console, stack: ExitStack) -> LayerCache | None:
    """The running local layer cache (`--layer-cache`), or None to use `docker save` (the reason printed).

    Called on the main thread: the registry is told to die with the thread that started it (layercache.py)."""
    binary = registry_binary()
    if mode == "off" or (binary is None and mode == "auto"):
        return None
    try:
        if binary is None:
            raise LayerCacheError(f"layer cache: {REGISTRY_BINARY} is not installed here")
        return stack.enter_context(LayerCache.started(binary, cache_dir()))
    except LayerCacheError as err:
        _cache_failed(err, mode, name, console)
        return None


def fill_cache(cache: LayerCache, local: Any, local_id: str, layers: int, name: str, mode: str, console: Console,
               bars: Progress) -> CachedImage | None:
    """Push the image into the cache; None (the reason printed) when that fails."""
    pushed = _Pushed(bars, name)
    try:
        cached = cache.put(local, local_id, layers, pushed)
    except LayerCacheError as err:
        _cache_failed(err, mode, name, console)
        return None
    console.print(f"image {name}: local layer cache has it ({pushed.new} new layer{'' if pushed.new == 1 else 's'} of "
                  f"{len(cached.layers)}, {cached.total / 1e6:.0f} MB compressed)", markup=False, highlight=False)
    return cached
