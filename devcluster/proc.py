"""Running commands and daemons with a bound on every wait, and ending processes by id.

Daemons are started in their own session so that they outlive the Python process that made the
cluster (the CLI's `up` returns; a killed test leaves them for `gc`). Processes are only ever ended
by pid, after checking that the pid still belongs to the cluster (its command line or its network
namespace), so that a reused pid is never hit.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import CommandError, ToolMissingError

log = logging.getLogger(__name__)

NETNS_DIR = Path("/var/run/netns")


def need_tools(*names: str, packages: str = "iproute2 openssh-server openssh-client docker.io iptables util-linux") -> None:
    """Fail with one line naming every missing program and the Debian packages that bring them."""
    missing = [n for n in names if shutil.which(n) is None and not Path(n).is_file()]
    if missing:
        raise ToolMissingError(f"missing programs: {', '.join(missing)} (install: apt-get install {packages})")


def run(argv: Sequence[str], *, timeout: float = 30, check: bool = True, input: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command without a shell; raise CommandError naming it on failure or timeout."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input, env=env)
    except subprocess.TimeoutExpired as e:
        raise CommandError(f"`{' '.join(argv)}` ran past {timeout:.0f} s") from e
    except FileNotFoundError as e:
        raise ToolMissingError(f"`{argv[0]}` is not installed") from e
    if check and res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise CommandError(f"`{' '.join(argv)}` exited {res.returncode}: {msg[-1] if msg else ''}")
    return res


def in_netns(netns: str, argv: Sequence[str]) -> list[str]:
    """argv to run inside a netns. nsenter, not `ip netns exec`: the latter remounts /sys and hides
    the cgroup mounts, and dockerd then refuses to start ("Devices cgroup isn't mounted")."""
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--", *argv]


def spawn(argv: Sequence[str], logfile: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a daemon in its own session, output to logfile; it outlives this process."""
    with open(logfile, "ab") as out:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, env=env)


def wait_until(pred: Callable[[], bool], timeout: float, what: str,
               fail: Callable[[], str | None] | None = None) -> None:
    """Poll pred until true; raise CommandError(what) after timeout. fail() may return a reason to stop
    early (e.g. the daemon exited)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        if pred():
            return
        reason = fail() if fail else None
        if reason:
            raise CommandError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise CommandError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def socket_answers(path: Path) -> bool:
    """True if a Unix socket at path accepts a connection (its daemon is up)."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot: with the pid, identifies one process for good."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def read_pidfile(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pids_matching(fragment: str) -> list[int]:
    """Pids whose command line contains fragment (an absolute path of this cluster, never a bare name)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and fragment in cmdline(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def pids_in_netns(netns: str) -> list[int]:
    """Every process in the netns (sshd sessions, container processes of host-network containers...)."""
    if not (NETNS_DIR / netns).exists():
        return []
    res = run(["ip", "netns", "pids", netns], check=False, timeout=10)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def stop_pids(pids: Sequence[int], grace: float = 5.0) -> list[int]:
    """SIGTERM, wait up to grace, then SIGKILL and wait up to 5 s more. Returns pids still alive."""
    pids = [p for p in pids if p != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            _reap(pids)
            time.sleep(0.05)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return []
    log.warning("processes still alive after SIGKILL: %s", pids)
    return pids


def _reap(pids: Sequence[int]) -> None:
    """Collect our own exited children so they do not linger as zombies."""
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass
