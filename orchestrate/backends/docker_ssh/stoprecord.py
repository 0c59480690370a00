"""The stop record on the hosts (what it is for and its races: jobs/stops.py): a file in the login's job folder on
every host (`~/.local/share/ddp-cifar/jobs/JOB/stop`, written atomically), written, looked for and removed over the
hosts' SSH sessions. It is per login (its home): another account's `up` of a job of the same name is never stopped."""

from __future__ import annotations

import posixpath
import socket
import time

from orchestrate.errors import MultiHostError, SSHError
from orchestrate.fanout import fan_out
from orchestrate.remote.session import Session

JOBS_FOLDER = ".local/share/ddp-cifar/jobs"  # under the login's home; the default checkpoint/log dirs live there too
RECORD = "stop"


def record_path(home: str, job: str) -> str:
    """PURE: where the stop record of `job` lives for a login whose home is `home`."""
    return posixpath.join(home, JOBS_FOLDER, job, RECORD)


def leave(nodes: Session, job: str) -> dict[str, BaseException | str]:
    """Write the stop record on every reachable host; the hosts where it could not be written, by label."""
    note = f"stopped by 'kill' on {socket.gethostname()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode()

    def one(rank: int) -> None:
        conn = nodes.conn(rank)
        path = record_path(conn.identity().home, job)
        conn.run(["mkdir", "-p", "--", posixpath.dirname(path)], timeout=30, check=True)
        conn.write_file(path, iter((note,)), timeout=30)

    try:
        fan_out("stop record", nodes.reachable(), one, lambda r: nodes.hosts[r].label)
    except MultiHostError as err:
        return dict(err.failures)
    return {}


def seen(nodes: Session, job: str) -> bool:
    """Whether any reachable host holds the job's stop record (a host that does not answer counts as none)."""
    def one(rank: int) -> bool:
        try:
            conn = nodes.conn(rank)
            return conn.run(["test", "-e", record_path(conn.identity().home, job)], timeout=15).rc == 0
        except (SSHError, OSError):
            return False

    return any(fan_out("stop record", nodes.reachable(), one, lambda r: nodes.hosts[r].label))


def clear(nodes: Session, job: str) -> None:
    """Remove an earlier kill's record before a new `up` starts anything; MultiHostError where it cannot."""
    def one(rank: int) -> None:
        conn = nodes.conn(rank)
        conn.run(["rm", "-f", "--", record_path(conn.identity().home, job)], timeout=30, check=True)

    fan_out("stop record", nodes.reachable(), one, lambda r: nodes.hosts[r].label)
