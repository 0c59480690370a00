"""The stop record (orchestrate/jobs/stops.py; Docker over SSH's, backends/docker_ssh/stoprecord.py) through Connection's calls run on this machine, one home per host;
write.sh is the real script. The record seen by a real `up` on real hosts: tests/cluster/test_self_healing.py."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from orchestrate.backends.docker_ssh import stoprecord as stops
from orchestrate.remote.identity import Identity
from orchestrate.remote.session import Session
from orchestrate.remote.ssh import WRITE_SCRIPT, Result


class LocalConn:
    """A host whose login's home is `home`, its commands run here."""

    def __init__(self, label: str, home: Path) -> None:
        self.host, self.home, self.dropped = SimpleNamespace(label=label), home, False

    def identity(self) -> Identity:
        return Identity(0, 0, "me", str(self.home))

    def run(self, argv: list[str], timeout: float = 60.0, check: bool = False) -> Result:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)
        return Result(done.returncode, done.stdout, done.stderr)

    def write_file(self, path: str, chunks: Iterator[bytes], timeout: float = 3600.0) -> None:
        subprocess.run(["sh", "-c", WRITE_SCRIPT, "write", path], input=b"".join(chunks), check=True, timeout=timeout)

    def close(self) -> None:
        pass


def nodes_in(tmp_path: Path, count: int) -> Session:
    conns = [LocalConn(f"h{i}", tmp_path / f"home{i}") for i in range(count)]
    return Session([c.host for c in conns], conns)  # type: ignore[misc,arg-type]


def test_a_record_left_on_any_host_is_seen_and_cleared_for_that_job_only(tmp_path: Path) -> None:
    nodes = nodes_in(tmp_path, 2)
    assert not stops.seen(nodes, "j")
    assert stops.leave(nodes, "j") == {}
    record = tmp_path / "home1" / ".local/share/ddp-cifar/jobs/j/stop"
    assert "stopped by 'kill' on " in record.read_text()
    assert stops.seen(nodes, "j") and not stops.seen(nodes, "other")
    (tmp_path / "home0" / ".local/share/ddp-cifar/jobs/j/stop").unlink()  # one host's record is enough
    assert stops.seen(nodes, "j")
    stops.clear(nodes, "j")
    assert not stops.seen(nodes, "j") and not record.exists()


def test_a_host_where_the_record_cannot_be_written_is_reported_and_the_others_still_get_it(tmp_path: Path) -> None:
    nodes = nodes_in(tmp_path, 2)
    (tmp_path / "home0").write_text("a file where the home should be")
    failed = stops.leave(nodes, "j")
    assert list(failed) == ["h0"]
    assert stops.seen(nodes, "j")
