"""Files on a host, read over its SSH session (`plot`'s metrics, `tensorboard`'s event files: Scheduler.read_file,
Scheduler.files_named; the boot id and GPU driver a GPU probe is remembered against: Scheduler.boot_and_driver)."""

from __future__ import annotations

from pathlib import PurePosixPath

from orchestrate.remote import scripts
from orchestrate.remote.session import Session

FILES_NAMED = scripts.text("event_files.sh")
# The kernel's boot id (new on every boot), then the loaded kernel module's version text (missing without a driver:
# the boot id alone is answered).
BOOT_AND_DRIVER = ["sh", "-c", "cat /proc/sys/kernel/random/boot_id && cat /proc/driver/nvidia/version"]
BOOT_AND_DRIVER_TIMEOUT_S = 15.0


def listing(text: str) -> list[tuple[str, int]]:
    """PURE: (path under the folder, bytes) of event_files.sh's lines ("<bytes> ./<path>"); a line that is not one
    (a stat error) is left out."""
    out = []
    for line in text.splitlines():
        size, _, name = line.partition(" ")
        if size.isdigit() and name:
            out.append((str(PurePosixPath(name)), int(size)))
    return out


def files_named(nodes: Session, host: int, folder: str, prefix: str) -> list[tuple[str, int]]:
    res = nodes.conn(host).run(["sh", "-c", FILES_NAMED, "event_files", folder, prefix], timeout=60)
    return listing(res.out)


def boot_and_driver(nodes: Session, host: int) -> str:
    return nodes.conn(host).run(BOOT_AND_DRIVER, timeout=BOOT_AND_DRIVER_TIMEOUT_S).out
