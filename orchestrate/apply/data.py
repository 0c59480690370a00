"""Per node, idempotent: create the dirs, then fetch + verify + extract CIFAR-10 into the data dir.

The work runs on the node in a short `--rm --network=host` container of the job's image, with a stdlib-only
script passed as an argument (no shell), so the node needs nothing but Docker. A node whose data dir holds the
verified marker for the expected md5 is left alone: nothing is downloaded or sent.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrate.apply.datalock import data_lock
from orchestrate.config import UpConfig
from orchestrate.errors import SSHError
from orchestrate.jobs.owner import owner_labels
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection
from trainer.contract import ARCHIVE_NAME, BASE_FOLDER

MARKER = ".ddp-cifar-verified"
BATCHES = BASE_FOLDER
ARCHIVE = ARCHIVE_NAME
SCRIPT = scripts.text("fetch.py")


@dataclass(frozen=True)
class PrefetchResult:
    label: str
    action: str  # "present" | "downloaded" | "sent" | "shared"
    bytes_moved: int
    shared_with: str = ""  # for "shared": the node whose fetch filled the same folder


def make_dirs(conn: Connection, dirs: Mapping[str, str]) -> Mapping[str, str]:
    """Create the node's planned dirs as the SSH login (so they are the user's)."""
    conn.run(["mkdir", "-p", "--", *dirs.values()], timeout=30, check=True)
    return dirs


def has_verified_copy(conn: Connection, data_dir: str, md5: str) -> bool:
    res = conn.run(["sh", "-c", 'test -d "$2" && cat -- "$1"', "marker", posixpath.join(data_dir, MARKER),
                    posixpath.join(data_dir, BATCHES)], timeout=30)
    return res.rc == 0 and res.out.strip() == md5


def prefetch_node(conn: Connection, data_dir: str, docker_client: Callable[[], object], config: UpConfig,
                  progress: Callable[[int, int], None], say: Callable[[str], None]) -> PrefetchResult:
    """A verified CIFAR-10 copy in the node's (existing) data dir, which the plan found without one, made under
    the folder's lock (another `up` filling it is waited for, then its copy is used). Raises SSHError saying what
    went wrong."""
    with data_lock(conn, data_dir, say) as held:
        if has_verified_copy(conn, data_dir, config.data_md5):  # made by the up that held the lock before us
            return PrefetchResult(conn.host.label, "present", 0)
        if not held.writable:
            raise held.refuse(data_dir, "holds no verified copy")
        return _fill(conn, docker_client, config, data_dir, progress)


def _fill(conn: Connection, docker_client: Callable[[], object], config: UpConfig, data_dir: str,
          progress: Callable[[int, int], None]) -> PrefetchResult:
    sent = 0
    url = config.data_url
    if config.data_from is not None:
        sent = _send_archive(conn, config.data_from, config.data_md5, posixpath.join(data_dir, ARCHIVE), progress)
        url = "-"
    fetched = _run_fetch(conn, docker_client(), config, url, data_dir, progress)  # a client only when needed
    return PrefetchResult(conn.host.label, "sent" if sent else "downloaded", sent or fetched)


def _send_archive(conn: Connection, local: Path, md5: str, remote: str, progress: Callable[[int, int], None]) -> int:
    """Upload the archive unless the node holds one with the expected md5 (a corrupt copy of the same size is
    replaced, not trusted); the upload goes through a temporary name (Connection.write_file)."""
    have = conn.run(["md5sum", "--", remote], timeout=300)
    if have.rc == 0 and have.out.split()[:1] == [md5]:
        return 0
    size = local.stat().st_size

    def blocks() -> Iterator[bytes]:
        done = 0
        with open(local, "rb") as fh:
            while block := fh.read(1 << 20):
                done += len(block)
                progress(done, size)
                yield block

    conn.write_file(remote, blocks())
    return size


def _run_fetch(conn: Connection, docker_client: object, config: UpConfig, url: str, data_dir: str,
               progress: Callable[[int, int], None]) -> int:
    import docker.types

    client = docker_client  # a DockerClient over this host's SSH connection
    container = client.containers.run(  # type: ignore[attr-defined]
        config.image, command=["python", "-c", SCRIPT, config.data_md5, "/data", ARCHIVE, BATCHES, MARKER], detach=True,
        network_mode="host", mounts=[docker.types.Mount("/data", data_dir, type="bind")],
        labels={"ddp-cifar.prefetch": config.job, **owner_labels(conn.identity().user_spec, conn.identity().name)},
        name=None,
        # As the SSH login, so the extracted files are theirs (root stays root); HOME: the image's is root's.
        user=conn.identity().user_spec, environment={"HOME": "/tmp", "DATA_URL": url},
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


def shared_folders(conns: Sequence[Connection], folders: Sequence[str]) -> list[int]:
    """For each node, the first node that sees the same folder (itself when it shares with none earlier).

    Each node writes a file with a random token and its index into its folder; a node that lists the files of
    others there shares the folder with them (an NFS home, a /data mount), whatever the paths are called."""
    from orchestrate.remote.ssh import fan_out

    prefix = f".ddp-cifar-share-{secrets.token_hex(8)}-"
    ranks = list(range(len(conns)))
    fan_out("shared-storage check", ranks, lambda i: _token(conns[i], posixpath.join(folders[i], f"{prefix}{i}")),
            lambda i: conns[i].host.label)
    try:
        seen = fan_out("shared-storage check", ranks, lambda i: conns[i].list_dir(folders[i]),
                       lambda i: conns[i].host.label)
    finally:
        fan_out("shared-storage check", ranks,
                lambda i: conns[i].run(["rm", "-f", "--", posixpath.join(folders[i], f"{prefix}{i}")], timeout=30),
                lambda i: conns[i].host.label)
    return [min([i] + [int(n[len(prefix):]) for n in seen[i] if n.startswith(prefix) and n[len(prefix):].isdigit()])
            for i in ranks]


def _token(conn: Connection, path: str) -> None:
    """An empty file; none in a folder the login may not write (another person's, only read: datalock.py)."""
    if conn.run(["test", "-w", posixpath.dirname(path)], timeout=30).rc == 0:
        conn.write_file(path, iter((b"",)), timeout=30)


def prefetch_all(conns: Sequence[Connection], dirs: Sequence[Mapping[str, str]], present: Sequence[bool],
                 client_for: Callable[[int], object], config: UpConfig, console: object) -> list[PrefetchResult]:
    """Dirs on every node, then one fetch per distinct data folder (nodes that share a folder, as on NFS, get
    it once) where the plan found no verified copy, in parallel with one progress bar per node; every failure is
    reported."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from orchestrate.remote.ssh import fan_out

    ranks = list(range(len(conns)))
    fan_out("data dirs", ranks, lambda i: make_dirs(conns[i], dirs[i]), lambda i: conns[i].host.label)
    leaders = shared_folders(conns, [d["data"] for d in dirs])
    fetching = [i for i, lead in enumerate(leaders) if lead == i and not present[i]]
    with Progress(TextColumn("data {task.description}"), BarColumn(), DownloadColumn(),
                  console=console, transient=True) as bars:  # type: ignore[arg-type]
        tasks = {i: bars.add_task(conns[i].host.label, total=None) for i in fetching}

        def say(line: str) -> None:
            bars.console.print(line, markup=False, highlight=False)

        def one(i: int) -> PrefetchResult:
            def update(done: int, total: int) -> None:
                bars.update(tasks[i], completed=done, total=total or None)
            return prefetch_node(conns[i], dirs[i]["data"], lambda: client_for(i), config, update, say)

        fetched = dict(zip(fetching, fan_out("data prefetch", fetching, one, lambda i: conns[i].host.label),
                           strict=True))
    return [fetched[i] if i in fetched else PrefetchResult(conns[i].host.label, "present", 0) if present[i] else
            PrefetchResult(conns[i].host.label, "shared", 0, shared_with=conns[leaders[i]].host.label)
            for i in range(len(conns))]
