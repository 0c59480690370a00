"""Per node, idempotent: create the dirs, then fetch + verify + extract CIFAR-10 into the data dir.

The work runs on the node in a short `--rm --network=host` container of the job's image, with a stdlib-only
script passed as an argument (no shell), so the node needs nothing but Docker. A node whose data dir holds the
verified marker for the expected md5 is left alone: nothing is downloaded or sent.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import UpConfig
from .errors import SSHError
from .plan import host_dirs
from .ssh import Connection

SCRIPT = (Path(__file__).parent / "_fetch_script.py").read_text()
MARKER = ".ddp-cifar-verified"
BATCHES = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"


@dataclass(frozen=True)
class PrefetchResult:
    label: str
    action: str  # "present" | "downloaded" | "sent"
    bytes_moved: int


def make_dirs(conn: Connection, config: UpConfig) -> dict[str, str]:
    dirs = host_dirs(config, conn.host)
    conn.run(["mkdir", "-p", "--", *dirs.values()], timeout=30, check=True)
    return dirs


def has_verified_copy(conn: Connection, data_dir: str, md5: str) -> bool:
    sftp = conn.sftp()
    try:
        with sftp.open(posixpath.join(data_dir, MARKER)) as fh:
            marker = fh.read().decode().strip()
        sftp.stat(posixpath.join(data_dir, BATCHES))
    except OSError:
        return False
    return marker == md5


def prefetch_node(conn: Connection, docker_client: Callable[[], object], config: UpConfig,
                  progress: Callable[[int, int], None]) -> PrefetchResult:
    """Make the dirs and a verified CIFAR-10 copy on one node. Raises SSHError saying what went wrong."""
    dirs = make_dirs(conn, config)
    data_dir = dirs["data"]
    if has_verified_copy(conn, data_dir, config.data_md5):
        return PrefetchResult(conn.host.label, "present", 0)
    sent = 0
    url = config.data_url
    if config.data_from is not None:
        sent = _send_archive(conn, config.data_from, posixpath.join(data_dir, ARCHIVE), progress)
        url = "-"
    fetched = _run_fetch(conn, docker_client(), config, url, data_dir, progress)  # a client only when needed
    return PrefetchResult(conn.host.label, "sent" if sent else "downloaded", sent or fetched)


def _send_archive(conn: Connection, local: Path, remote: str, progress: Callable[[int, int], None]) -> int:
    size = local.stat().st_size
    sftp = conn.sftp()
    try:
        if sftp.stat(remote).st_size == size:
            return 0  # same size already there; the md5 check in the container decides
    except OSError:
        pass
    sftp.put(str(local), remote + ".part", callback=progress)
    sftp.posix_rename(remote + ".part", remote)
    return size


def _run_fetch(conn: Connection, docker_client: object, config: UpConfig, url: str, data_dir: str,
               progress: Callable[[int, int], None]) -> int:
    import docker.types

    client = docker_client  # a DockerClient over this host's SSH connection
    container = client.containers.run(  # type: ignore[attr-defined]
        config.image, command=["python", "-c", SCRIPT, url, config.data_md5, "/data"], detach=True,
        network_mode="host", mounts=[docker.types.Mount("/data", data_dir, type="bind")],
        labels={"ddp-cifar.prefetch": config.job}, name=None,
    )
    lines: list[str] = []
    try:
        for raw in container.logs(stream=True, follow=True):
            for line in raw.decode(errors="replace").splitlines():
                lines.append(line)
                if line.startswith("PROGRESS "):
                    _, done, total = line.split()
                    progress(int(done), int(total))
        code = container.wait(timeout=3600).get("StatusCode", -1)
    finally:
        try:
            container.remove(force=True)
        except Exception:  # best effort: the container is ours (labelled) and already finished
            pass
    if code != 0:
        error = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "no output")
        raise SSHError(f"data prefetch into {data_dir} failed: {error.removeprefix('error: ')}")
    done = next((ln for ln in lines if ln.startswith("DONE ")), "DONE 0")
    return int(done.split()[1])


def prefetch_all(conns: Sequence[Connection], client_for: Callable[[int], object], config: UpConfig,
                 console: object) -> list[PrefetchResult]:
    """Prefetch on every node in parallel with one progress bar per node; every failure is reported."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from .ssh import fan_out

    with Progress(TextColumn("data {task.description}"), BarColumn(), DownloadColumn(),
                  console=console, transient=True) as bars:  # type: ignore[arg-type]
        tasks = [bars.add_task(c.host.label, total=None) for c in conns]

        def one(i: int) -> PrefetchResult:
            def update(done: int, total: int) -> None:
                bars.update(tasks[i], completed=done, total=total or None)
            return prefetch_node(conns[i], lambda: client_for(i), config, update)

        return fan_out("data prefetch", list(range(len(conns))), one, lambda i: conns[i].host.label)
