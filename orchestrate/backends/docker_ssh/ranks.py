"""Each rank's container as the watcher observes it through its host's Docker API (its state, its exit, its logs),
and its host through the SSH session (the files the container wrote, the host's boot): the Ranks of
backends/protocol.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from orchestrate.backends.docker_ssh.checkpoints import newest_valid
from orchestrate.backends.docker_ssh.control import LogResume
from orchestrate.backends.docker_ssh.hostboot import read_boot
from orchestrate.backends.docker_ssh.rfc3339 import docker_time
from orchestrate.backends.protocol import RankState
from orchestrate.probe.bootchange import Boot
from orchestrate.probe.observations import Checkpoint
from orchestrate.remote import scripts
from orchestrate.remote.session import Session

# Run with the container's Python inside the job's container: SIGUSR1 to every rank process.
SIGNAL_RANKS = scripts.text("signal_ranks.py")


class ContainerRanks:
    """The containers of one attempt, node by node.

    SSH channels held per host while watched: the log stream, the wait (both on a client without a read timeout:
    logs may be quiet for long, liveness is the polls' job), and the polls' pooled connection: 3."""

    def __init__(self, nodes: Session, containers: Sequence[Any]) -> None:
        self.nodes = nodes
        self.ids = [str(c.id) for c in containers]
        self.resumes = [LogResume() for _ in containers]
        self._lock = threading.Lock()  # Session.docker is not for concurrent first use (the stream and the wait)

    def _streaming(self, rank: int) -> Any:
        with self._lock:
            return self.nodes.docker(rank, timeout=None)

    def follow(self, rank: int) -> Iterator[bytes]:
        """Asked with timestamps: a stream opened again goes on after the last line given (LogResume)."""
        resume = self.resumes[rank]
        chunks = self._streaming(rank).api.logs(self.ids[rank], stream=True, follow=True, timestamps=True,
                                                since=resume.since())
        return resume.unstamped(chunks)

    def running(self, rank: int) -> bool:
        return bool(self._streaming(rank).api.inspect_container(self.ids[rank])["State"]["Running"])

    def wait_exit(self, rank: int) -> None:
        self._streaming(rank).api.wait(self.ids[rank])

    def state(self, rank: int) -> RankState | None:
        # The client the earlier phases used (its idle pooled channel): no extra channel for the polls.
        import docker.errors

        try:
            state = self.nodes.docker(rank).api.inspect_container(self.ids[rank])["State"]
        except docker.errors.NotFound:
            return None
        return RankState(str(state.get("Status")), int(state.get("ExitCode", 0)), bool(state.get("OOMKilled")),
                         docker_time(str(state.get("StartedAt", ""))))

    def last_lines(self, rank: int, tail: int) -> str:
        return str(self.nodes.docker(rank).api.logs(self.ids[rank], tail=tail).decode(errors="replace"))

    def signal_ranks(self, rank: int) -> list[int]:
        res = self.nodes.docker(rank).containers.get(self.ids[rank]).exec_run(["python3", "-c", SIGNAL_RANKS])
        try:
            return sorted(int(r) for r in json.loads(res.output.decode(errors="replace").strip().splitlines()[-1]))
        except (ValueError, IndexError, AttributeError):
            return []

    def read_file(self, rank: int, path: str, timeout: float) -> bytes:
        return self.nodes.conn(rank).read_file(path, timeout=timeout)

    def write_file(self, rank: int, path: str, data: bytes, timeout: float) -> None:
        self.nodes.conn(rank).write_file(path, iter((data,)), timeout=timeout)

    def newest_checkpoint(self, rank: int, folder: str) -> Checkpoint | None:
        return newest_valid(self.nodes.conn(rank), folder)

    def boot(self, rank: int) -> Boot | None:
        return read_boot(self.nodes.conn(rank))

    def lose(self, rank: int, why: str) -> None:
        self.nodes.lose(rank, why)
