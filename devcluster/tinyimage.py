"""A tiny image made from this machine's own binaries, for tests that need *an* image but not the
trainer's (no registry is reachable, and `ddp-cifar:cpu` takes minutes to build).

The image holds sh, cat, sleep, ip, hostname and their shared libraries, as found by ldd.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import docker

from .errors import ToolMissingError

PROGRAMS = ("sh", "cat", "sleep", "ls", "ip", "hostname", "env", "true")
TINY_IMAGE = "devcluster-tiny:latest"


def _libs(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=10).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
        if path.startswith("/"):
            libs.append(Path(path))
    return libs


def _usr_path(path: Path) -> str:
    """The archive path of path under merged /usr (/lib64/x -> usr/lib64/x)."""
    text = str(path)
    for top in ("/bin/", "/lib/", "/lib64/", "/sbin/"):
        if text.startswith(top):
            text = "/usr" + ("/bin/" if top == "/sbin/" else top) + text[len(top):]
    return text.lstrip("/")


def rootfs_tar(programs: tuple[str, ...] = PROGRAMS) -> bytes:
    """A tar of a root filesystem with the programs and their libraries at their real paths, plus a
    link at each path they are known by (e.g. the loader's /lib64/ld-linux-x86-64.so.2)."""
    paths: set[Path] = set()
    for name in programs:
        found = shutil.which(name)
        if found is None:
            raise ToolMissingError(f"tiny image: `{name}` not found on this machine")
        paths.add(Path(found))
        paths.update(_libs(Path(found).resolve()))
    entries: dict[str, Path | str] = {}  # archive path -> real file, or link target (str)
    for p in paths:
        real = p.resolve()
        entries[_usr_path(real)] = real
        if _usr_path(p) != _usr_path(real):
            entries.setdefault(_usr_path(p), "/" + _usr_path(real))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("tmp", "proc", "sys", "dev", "etc", "usr/bin", "usr/lib", "usr/lib64"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for link in ("bin", "lib", "lib64", "sbin"):  # merged /usr, as on Debian 12
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{'bin' if link == 'sbin' else link}"
            tar.addfile(info)
        for arc, src in sorted(entries.items()):
            if isinstance(src, Path):
                tar.add(str(src), arcname=arc, recursive=False)
            else:
                info = tarfile.TarInfo(arc)
                info.type, info.linkname = tarfile.SYMTYPE, src
                tar.addfile(info)
    return buf.getvalue()


def load_tiny_image(client: docker.DockerClient, tag: str = TINY_IMAGE) -> str:
    """Import the tiny image into the daemon behind client; returns its ID."""
    repo, _, version = tag.partition(":")
    client.api.import_image_from_data(rootfs_tar(), repository=repo, tag=version or "latest")
    return str(client.images.get(tag).id)
