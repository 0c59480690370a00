"""Mounts a host's dockerd leaves under its folders (overlay, shm, netns binds) and their removal."""

from __future__ import annotations

from pathlib import Path

from .proc import run


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below root, deepest first (the order to unmount them in)."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])
        if point == str(root) or point.startswith(prefix):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def unmount_under(root: Path) -> list[Path]:
    """Unmount everything below root; a busy mount is detached lazily. Returns what is still mounted."""
    for point in mounts_under(root):
        if run(["umount", str(point)], check=False, timeout=10).returncode != 0:
            run(["umount", "-l", str(point)], check=False, timeout=10)
    return mounts_under(root)


def fs_type(path: Path) -> str:
    """Filesystem type of the mount that holds path (longest mount point that is a prefix of it)."""
    best, kind = "", ""
    target = str(path.resolve())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = _unescape(fields[4])
        fstype = fields[fields.index("-") + 1]
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind
