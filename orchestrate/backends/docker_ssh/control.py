"""kill / status / logs: find the job's containers by label on every host; never touch anything else."""

from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import docker.errors
from rich.console import Console

from orchestrate import labels
from orchestrate.backends.docker_ssh import jobview, owner
from orchestrate.backends.docker_ssh.checkpoints import newest_manifest
from orchestrate.backends.docker_ssh.jobview import folder_of, node_rank
from orchestrate.backends.protocol import JobStatus, NodeLog, RankFiles, StatusRow
from orchestrate.errors import JobError, MultiHostError
from orchestrate.fanout import fan_out
from orchestrate.labels import JOB_LABEL, PREFETCH_LABEL
from orchestrate.masking import mask_text
from orchestrate.plan.jobplan import CKPT_MOUNT, LOG_MOUNT
from orchestrate.remote import scripts
from orchestrate.remote.docker import job_containers
from orchestrate.remote.session import Session


@dataclass(frozen=True)
class KillResult:
    label: str
    stopped: list[str]
    exit_codes: dict[str, int]
    others: str | None = None  # the other owners of a job of this name here (owner.others_line), left alone


def kill_on_host(client: Any, job: str, grace: float, label: str, uid: int) -> KillResult:
    """SIGTERM every container of the job here that belongs to the login `uid`, force-kill after `grace` s, then
    remove them. Idempotent. Another owner's containers of the same job name are left alone."""
    containers = job_containers(client, job)
    containers += [c for c in client.containers.list(all=True, filters={"label": f"{PREFETCH_LABEL}={job}"},
                                                   ignore_removed=True)
                   if c.labels.get(PREFETCH_LABEL) == job]
    others = owner.others_line(job, containers, uid)
    containers = [c for c in containers if labels.is_mine(c.labels, uid)]
    for c in containers:
        assert c.labels.get(JOB_LABEL) == job or c.labels.get(PREFETCH_LABEL) == job  # never anyone else's
    running = [c for c in containers if c.status in ("running", "restarting", "paused", "created")]
    # docker stop = SIGTERM (the trainer checkpoints), then SIGKILL once the grace period is over.
    fan_out("stop", running, lambda c: _unless_gone(lambda: c.stop(timeout=int(grace))), lambda c: c.name)
    codes: dict[str, int] = {}
    for c in containers:
        if _unless_gone(c.reload):
            codes[c.name] = int(c.attrs.get("State", {}).get("ExitCode", -1))
        _unless_gone(lambda: c.remove(force=True))  # noqa: B023  # called at once, inside this iteration
    return KillResult(label, [c.name for c in running], codes, others)


def _unless_gone(action: Callable[[], object]) -> bool:
    """Run a Docker call on a container that another stop may be removing at the same moment (a `kill` typed
    while an attached `up` stops the job): gone (404) or already being removed (409 on a forced remove) is the
    outcome wanted, not a failure. False when the container was gone."""
    try:
        action()
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as e:
        if e.status_code != 409:
            raise
        return False
    return True


def kill_job(nodes: Session, job: str, grace: float, console: Console,
             unreachable: Mapping[str, BaseException | str] | None = None) -> list[KillResult]:
    """Kill on every reachable host in parallel; report unreachable (and lost) hosts and failures (non-zero exit)."""
    ranks = nodes.reachable()
    failures: dict[str, BaseException | str] = {**(unreachable or {}), **nodes.lost()}
    results: list[KillResult] = []

    def one(rank: int) -> KillResult:
        try:
            return kill_on_host(nodes.docker(rank), job, grace, nodes.hosts[rank].label, uid_of(nodes, rank))
        except Exception:
            # A kill is idempotent: one cut short because the connection dropped is done again on a new one.
            # A host that stopped answering keeps its (silent) connection and is not tried twice.
            if not nodes.conn(rank).dropped:
                raise
            return kill_on_host(nodes.docker(rank), job, grace, nodes.hosts[rank].label, uid_of(nodes, rank))

    try:
        results = fan_out("kill", ranks, one, lambda r: nodes.hosts[r].label)
    except MultiHostError as err:
        failures.update(err.failures)
        results = []
    for res in results:
        if res.exit_codes:
            codes = ", ".join(f"{n} exit {c}" for n, c in sorted(res.exit_codes.items()))
            console.print(f"{res.label}: stopped and removed {codes}", markup=False, highlight=False)
        else:
            console.print(f"{res.label}: no container of job {job!r} of yours", markup=False, highlight=False)
        if res.others:
            console.print(f"{res.label}: {res.others}", markup=False, highlight=False)
    if failures:
        raise MultiHostError(f"kill of job {job!r}", failures)
    refuse_others(results, job)
    return results


def refuse_others(results: Sequence[KillResult], job: str) -> None:
    """PURE: a kill that found only other people's job of this name fails (exit 1), with one line naming them."""
    if any(res.exit_codes for res in results):
        return
    others = sorted({res.others for res in results if res.others})
    if others:
        raise JobError(f"nothing stopped: {others[0]}")


def uid_of(nodes: Session, rank: int) -> int:
    """The SSH login's uid on a node: the owner whose containers a command may see and touch."""
    return nodes.conn(rank).identity().uid


def _uptime(started: str, running: bool) -> str:
    if not running or not started or started.startswith("0001"):
        return "-"
    try:
        start = datetime.fromisoformat(started[:26].rstrip("Z") + "+00:00")
    except ValueError:
        return "?"
    seconds = int((datetime.now(timezone.utc) - start).total_seconds())
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def _runs_trainer(container: Any) -> bool:
    """Whether torchrun in this container starts the bundled trainer (`-m trainer`) or another program."""
    cmd = list(container.attrs.get("Config", {}).get("Cmd") or [])
    return any(a == "-m" and b == "trainer" for a, b in zip(cmd, cmd[1:], strict=False))


def _secrets_of(container: Any) -> list[str]:
    from orchestrate.masking import is_secret

    pairs = [e.split("=", 1) for e in container.attrs.get("Config", {}).get("Env", []) if "=" in e]
    return [v for k, v in pairs if is_secret(k) and v]


def job_found(nodes: Session, job: str) -> dict[int, list[Any]]:
    """Host index -> the caller's containers of the job there, every reachable host listed once, in parallel."""
    hosts = nodes.reachable()
    found = fan_out("status", hosts, lambda r: owner.mine(nodes.docker(r), job, uid_of(nodes, r)),
                    lambda r: nodes.hosts[r].label)
    return dict(zip(hosts, found, strict=True))


def status_rows(nodes: Session, found: jobview.Found, unreachable: Mapping[str, str]) -> list[StatusRow]:
    """One row per container found on each reachable host; one per host without any or unreachable."""
    def one(rank: int) -> list[StatusRow]:
        label = nodes.hosts[rank].label
        if not found[rank]:
            return [StatusRow(str(rank), label, "-", "no container", "-", "-", "-", "-")]
        return [_status_row(nodes, rank, label, c) for c in sorted(found[rank], key=node_rank)]

    rows = [row for chunk in fan_out("status", list(found), one, lambda r: nodes.hosts[r].label) for row in chunk]
    rows += [StatusRow("?", label, "-", "UNREACHABLE", "-", "-", why[:80], "-") for label, why in unreachable.items()]
    return rows


def _status_row(nodes: Session, rank: int, label: str, c: Any) -> StatusRow:
    state = c.attrs.get("State", {})
    tail = c.logs(tail=8).decode(errors="replace").splitlines()
    # The last line that says something (torchrun ends its error report with a rule of '=').
    last = next((ln.strip() for ln in reversed(tail) if any(ch.isalnum() for ch in ln)), "")
    last = mask_text(last, _secrets_of(c))[:100]
    folder = folder_of(c)
    manifest = newest_manifest(nodes.conn(rank), folder) if folder else None
    # The newest checkpoint's file name (its folder is the job's; its step is in the name and the progress line)
    ckpt = posixpath.basename(str(manifest["file"])) if folder and manifest else \
        "-" if _runs_trainer(c) else "- (no manifest)"
    running = state.get("Status") == "running"
    return StatusRow(str(node_rank(c)), label, c.name, str(state.get("Status")),
                     "-" if running else str(state.get("ExitCode")), _uptime(state.get("StartedAt", ""), running),
                     last, ckpt)


def describe(nodes: Session, job: str, unreachable: Mapping[str, str]) -> JobStatus:
    """`status`: one row per node, then the lines under the table (jobview.py: node 0's progress, the straggler,
    every node's timings and GPU use, or the last run's progress; restarts), from one listing of each host."""
    found = job_found(nodes, job)
    return JobStatus(status_rows(nodes, found, unreachable), jobview.job_lines(nodes, found))


def job_dirs(nodes: Session, job: str, mount: str) -> dict[int, tuple[int, str]]:
    """Node rank -> (host index, host folder mounted at `mount`) of each of the job's containers found."""
    found = {}
    for host in nodes.reachable():
        for c in owner.mine(nodes.docker(host), job, uid_of(nodes, host)):
            folder = folder_of(c, mount)
            if folder:
                found[node_rank(c)] = (host, folder)
    return found


def node0_dir(nodes: Session, job: str, remembered: str | None, mount: str = CKPT_MOUNT) -> tuple[int, str]:
    """(host index, checkpoint dir, or log dir with `mount` LOG_MOUNT) of the job's node 0: from its container's
    mount, or, once the containers are gone (`kill`), from the options its last `up` used (`remembered`, ~ and
    {job} unexpanded)."""
    found = job_dirs(nodes, job, mount)
    if 0 in found:
        return found[0]
    if remembered is None or not nodes.reachable() or nodes.reachable()[0] != 0:
        raise JobError(f"no container of job {job!r} on node 0 and no record of its folders; "
                       "give --hosts (node 0 first) of a job that ran here")
    home = nodes.conn(0).identity().home
    folder = (nodes.hosts[0].log_dir if mount == LOG_MOUNT else nodes.hosts[0].ckpt_dir) or remembered
    folder = folder.replace("{job}", job)
    return 0, home.rstrip("/") + folder[1:] if folder == "~" or folder.startswith("~/") else folder


def node_logs(nodes: Session, job: str, node: int | None, tail: int, follow: bool) -> list[NodeLog]:
    """The logs of the job's containers (or of node `node`'s), node order; with `follow` as they come."""
    targets: list[tuple[int, Any]] = []
    for rank in nodes.reachable():
        for c in owner.mine(nodes.docker(rank, timeout=None if follow else 60), job, uid_of(nodes, rank)):
            if node is None or node_rank(c) == node:
                targets.append((node_rank(c), c))
    if not targets:
        raise JobError(f"no container of job {job!r} found" + (f" for node {node}" if node is not None else "")
                       + "; check the job name (--job) and hosts")
    targets.sort(key=lambda t: t[0])
    if follow:
        return [NodeLog(rank, closing(c.logs(stream=True, follow=True, tail=100)), _secrets_of(c)) for rank, c in targets]
    return [NodeLog(rank, iter((c.logs(tail=tail or "all"),)), _secrets_of(c)) for rank, c in targets]


def closing(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """A docker-py log stream that hands its SSH channel back once done with, or closed early. docker-py's stream
    (a CancellableStream) keeps its HTTP connection, an SSH channel, out of the pool after the end; its close()
    refuses SSH sockets. Closing the response hands the connection back."""
    try:
        yield from chunks
    finally:
        response = getattr(chunks, "_response", None)
        if response is not None:
            response.close()


# torchrun's --log-dir holds one folder per start, <run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log.
# The run folder is mkdtemp's (0700, owned by the container's user), so a non-root login may list the log dir
# but not enter it: the files are read through the job's container (Docker's archive API, exited ones too).
NEWEST_RUN = scripts.text("newest_run.sh")
STREAMS = ("stdout.log", "stderr.log")


def rank_files(tar_bytes: bytes, local_rank: int) -> dict[str, str]:
    """PURE: {"stdout": text, "stderr": text} of the newest attempt of `local_rank` in a run folder's archive."""
    found: dict[tuple[int, str], str] = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")  # <run>/attempt_<n>/<local rank>/<stream>.log
            if (member.isfile() and len(parts) == 4 and parts[1].startswith("attempt_")
                    and parts[1][8:].isdigit() and parts[2] == str(local_rank) and parts[3] in STREAMS):
                data = tar.extractfile(member)
                found[(int(parts[1][8:]), parts[3][:-4])] = data.read().decode(errors="replace") if data else ""
    newest = max((attempt for attempt, _ in found), default=None)
    return {stream: text for (attempt, stream), text in found.items() if attempt == newest}


def _env_of(container: Any) -> dict[str, str]:
    return dict(e.split("=", 1) for e in container.attrs.get("Config", {}).get("Env", []) if "=" in e)


def locate_rank(nodes_nproc: Sequence[tuple[int, int]], rank: int) -> tuple[int, int] | None:
    """PURE: (node rank, local rank) of a global rank; torchrun numbers ranks node by node, node 0 first.
    `nodes_nproc`: (node rank, processes on that node) for every node."""
    first = 0
    for node, nproc in sorted(nodes_nproc):
        if first <= rank < first + nproc:
            return node, rank - first
        first += nproc
    return None


def rank_logs(nodes: Session, job: str, rank: int, tail: int, follow: bool = False) -> RankFiles:
    """One global rank's stdout and stderr files (torchrun --log-dir) from the node that ran it (the last `tail`
    lines of each, 0: all); with `follow`, then its new lines as they come (torchrun's `[default<local rank>]:`
    lines of the node's log)."""
    found: dict[int, tuple[int, Any, int]] = {}  # node rank → (host index, container, nproc)
    for host in nodes.reachable():
        for c in owner.mine(nodes.docker(host), job, uid_of(nodes, host)):
            try:
                found[node_rank(c)] = (host, c, int(_env_of(c).get("NPROC_PER_NODE", "")))
            except ValueError:
                raise JobError(f"container {c.name} has no NPROC_PER_NODE; was it started by this version?") from None
    where = locate_rank([(node, nproc) for node, (_, _, nproc) in found.items()], rank)
    if where is None:
        ranks = sum(n for _, _, n in found.values())
        raise JobError(f"no rank {rank} in job {job!r} ({ranks} rank(s) found on the reachable hosts); "
                       "give --rank 0.." + str(max(ranks - 1, 0)))
    host, container, _ = found[where[0]]
    folder = next((str(m.get("Source")) for m in container.attrs.get("Mounts", [])
                   if m.get("Destination") == LOG_MOUNT), None)
    run = nodes.conn(host).run(["sh", "-c", NEWEST_RUN, "newest", folder or "/nonexistent"], timeout=60).out.strip()
    files: dict[str, str] = {}
    if run and "/" not in run:
        chunks, _ = container.get_archive(f"{LOG_MOUNT}/{run}")
        files = rank_files(b"".join(chunks), where[1])
    if not files:
        raise JobError(f"no log files of rank {rank} under {nodes.hosts[host].label}:{folder}; "
                       "the job may predate per-rank logs")
    if tail:
        files = {stream: "\n".join(text.splitlines()[-tail:]) for stream, text in files.items()}
    more = _follow_rank(nodes.docker(host, timeout=None), container, where[1]) if follow else None
    return RankFiles(where[0], files, more, _secrets_of(container))


def _follow_rank(client: Any, container: Any, local: int) -> Iterator[str]:
    """The local rank's new lines in the node's log (torchrun prefixes them `[default<local rank>]:`)."""
    prefix, pending = f"[default{local}]:", ""
    for chunk in closing(client.api.logs(container.id, stream=True, follow=True, tail=0)):
        pending += chunk.decode(errors="replace")
        *lines, pending = pending.split("\n")
        yield from (line[len(prefix):] for line in lines if line.startswith(prefix))


class LogResume:
    """Follow a container's log again after a broken stream without showing a line twice or losing one.

    The stream is asked with timestamps=True: each line starts with its RFC 3339 time (nanoseconds, trailing
    zeros cut). A stream opened again starts a second before the last line shown, and lines up to it are skipped."""

    def __init__(self) -> None:
        self.last_ns = 0  # time of the last line shown, in ns since the epoch; 0: none yet

    def since(self) -> float | None:
        return self.last_ns / 1e9 - 1 if self.last_ns else None

    def unstamped(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The stream's lines without their time stamps, those already shown left out."""
        pending = b""
        for chunk in closing(chunks):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            yield from (line + b"\n" for line in self._new(lines))
        yield from self._new([pending] if pending else [])

    def _new(self, lines: list[bytes]) -> Iterator[bytes]:
        for line in lines:
            stamp, _, text = line.partition(b" ")
            ns = stamp_ns(stamp.decode(errors="replace"))
            if ns is None:  # not a stamped line: shown as it is
                yield line
            elif ns > self.last_ns:
                self.last_ns = ns
                yield text


def stamp_ns(stamp: str) -> int | None:
    """Nanoseconds since the epoch of Docker's RFC 3339 log stamp (2026-11-23T10:12:04.1234Z); None if not one."""
    whole, _, frac = stamp.rstrip("Z").partition(".")
    try:
        seconds = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
    if not stamp.endswith("Z") or (frac and not frac.isdigit()):
        return None
    return int(seconds) * 1_000_000_000 + int((frac or "0").ljust(9, "0")[:9])
