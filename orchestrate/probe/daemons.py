"""What the probe asks of the daemons (the image stores and container runtimes, here and on each node), answered in
the probe's own plain types. The scheduler answers (the Scheduler protocol, backends/protocol.py, includes this one; the
Docker reads are backends/docker_ssh/observe.py), so that the probe speaks no scheduler's API: it keeps the shell
probes over SSH and the pure reading and judging of what it is told."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from orchestrate.config import Resources
from orchestrate.probe.observations import Checkpoint, ContainerSeen, Holdings, Identity, LocalImage

# The connection to the nodes the reads go over, opaque here: the scheduler names it (Docker over SSH: its SSH Session).
NodesT = TypeVar("NodesT", contravariant=True)


class LocalStore(Protocol):
    """This machine's image store as a scheduler holds it (Docker: the local daemon's client). Opaque here: only the
    scheduler that handed it out reads it; above the scheduler it is carried (from `local_image` to the other local
    reads and the image's delivery), never used."""


Local = LocalStore | None  # None: there is no image store on this machine


class Daemons(Protocol[NodesT]):
    def local_image(self, name: str) -> tuple[Local, str | None]:
        """This machine's image store and the image's ID there ((None, None): no store here; ID None: no image)."""
        ...

    def local_layers(self, local: Local, image_id: str | None) -> LocalImage | None:
        """The local image's layers, their sizes where known, and its base (None: no local image)."""
        ...

    def local_platform(self, local: Local, image: str) -> tuple[str, str] | None:
        """(os, architecture) of the local image; None when there is no local image."""
        ...

    def address(self, nodes: NodesT, rank: int) -> str:
        """The address this machine reached the node at (preflight's `ssh` cell; node 0's is the default master)."""
        ...

    def identity(self, nodes: NodesT, rank: int) -> Identity:
        """The login on the node: containers run as it, ~ in the job's folders is its home (SSHError: unknown)."""
        ...

    def probe_host(self, nodes: NodesT, rank: int, resources: Resources, master_addr: str, master_ssh_port: int,
                   dirs: dict[str, str]) -> dict[str, str]:
        """Preflight's facts of the node, read by its shell probe about the job's `dirs` (Docker over SSH:
        backends/docker_ssh/hostprobe.py)."""
        ...

    def data_copy_verified(self, nodes: NodesT, rank: int, folder: str, md5: str) -> bool:
        """Whether the node's data `folder` holds a verified copy of the trainer's data (its marker says `md5`)."""
        ...

    def daemon_version(self, nodes: NodesT, rank: int) -> str:
        """The node's daemon answers: its version (SSHError naming why when it does not)."""
        ...

    def holdings(self, nodes: NodesT, rank: int, job: str, uid: int) -> Holdings:
        """What the containers on the node hold (GPU sets, node 0's master port), the caller's own of `job` apart."""
        ...

    def job_containers(self, nodes: NodesT, rank: int, job: str, uid: int) -> list[ContainerSeen]:
        """The caller's containers of `job` on the node (the login `uid`'s), running or not."""
        ...

    def image_id(self, nodes: NodesT, rank: int, image: str) -> str | None:
        """The image's ID on the node; None when it has none of that name."""
        ...

    def platforms(self, nodes: NodesT, ranks: Sequence[int]) -> list[tuple[str, str]]:
        """(os, `uname -m` machine) of each node's daemon, in `ranks` order (MultiHostError: one line per host)."""
        ...

    def chain_ids(self, nodes: NodesT, ranks: Sequence[int]) -> list[set[str]]:
        """The chain IDs of every image layer each node holds, in `ranks` order."""
        ...

    def registry_reach(self, nodes: NodesT, ranks: Sequence[int], ref: str) -> list[str]:
        """Whether each node's daemon gets `ref`'s manifest from its registry ("" yes, else why not), pulling
        nothing."""
        ...

    def newest_checkpoint(self, nodes: NodesT, rank: int, folder: str,
                          skipped: Callable[[str], None]) -> Checkpoint | None:
        """The newest checkpoint in the node's `folder` that checks out against its manifest (Docker over
        SSH: backends/docker_ssh/checkpoints.py); None when none does. `skipped` is told the path of each newer
        manifest whose checkpoint does not."""
        ...
