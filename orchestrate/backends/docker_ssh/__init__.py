"""Docker over SSH: each rank a container started through the host's Docker API, tunnelled over SSH. The request
is each container's docker-py arguments and the same as a `docker run` line (request.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import Console

from orchestrate.backends.docker_ssh import (
    carried,
    control,
    data,
    hostfiles,
    hostprobe,
    hostwait,
    layercache,
    observe,
    owner,
    shortrun,
    stoprecord,
)
from orchestrate.backends.docker_ssh.checkpoints import newest_valid
from orchestrate.backends.docker_ssh.claim import start_claimed
from orchestrate.backends.docker_ssh.datacopy import has_verified_copy
from orchestrate.backends.docker_ssh.delivery import send_data, send_image
from orchestrate.backends.docker_ssh.ranks import ContainerRanks
from orchestrate.backends.docker_ssh.relay import relay_address
from orchestrate.backends.docker_ssh.replicate import Replicator
from orchestrate.backends.docker_ssh.request import offline_json, plan_json, render_job_plan, render_plan
from orchestrate.backends.docker_ssh.start import copy_resume_checkpoint, remove_leftovers
from orchestrate.backends.protocol import (
    JobRow,
    JobStatus,
    NodeLog,
    RankFiles,
    Reached,
    Replan,
    Replication,
    Request,
    ShortRunResult,
    Submitted,
)
from orchestrate.config import Data, Delivery, Resources, SSHOptions
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import ContainerSpec, JobPlan
from orchestrate.probe.daemons import Local
from orchestrate.probe.observations import Checkpoint, ContainerSeen, Holdings, LocalImage
from orchestrate.remote.docker import image_id
from orchestrate.remote.identity import Identity
from orchestrate.remote.session import Session

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient


class DockerSSH:
    """The Scheduler of backends/protocol.py over each host's Docker daemon (its docstrings say what each does)."""

    def materialize(self, plan: JobPlan) -> Request:
        return plan_json(plan)

    def text(self, plan: JobPlan) -> str:
        return render_job_plan(plan)

    def materialize_offline(self, specs: Sequence[ContainerSpec]) -> Request:
        return offline_json(specs)

    def containers_text(self, specs: Sequence[ContainerSpec]) -> str:
        return render_plan(specs)

    def check_delivery(self, delivery: Delivery) -> None:
        layercache.require_registry(delivery)

    def fetch_script(self) -> str:
        return data.SCRIPT

    def submit(self, nodes: Session, plan: JobPlan, grace: float, replan: Replan, console: Console) -> Submitted:
        remove_leftovers(nodes, plan.job, grace, [n.rank for n in plan.nodes if n.leftovers])
        claim = start_claimed(nodes, plan.specs, replan, console)
        return Submitted(plan.with_claim(claim.specs, claim.port), ContainerRanks(nodes, claim.containers))

    def run(self, nodes: Session, specs: Mapping[int, ContainerSpec], timeout: float, what: str,
            together: bool = False) -> dict[int, ShortRunResult]:
        return shortrun.run(nodes, specs, timeout, what, together)

    def send_image(self, nodes: Session, plan: JobPlan, local: Local, local_id: str | None, delivery: Delivery,
                   console: Console) -> None:
        send_image(nodes, plan, local, local_id, delivery, console)

    def send_data(self, nodes: Session, plan: JobPlan, data: Data, console: Console) -> None:
        send_data(nodes, plan, data, console)

    def place_resume_checkpoint(self, nodes: Session, plan: JobPlan, say: Callable[[str], None]) -> None:
        copy_resume_checkpoint(nodes, plan, say, lambda rank: relay_address(nodes, rank, plan.master))

    def load_carried(self, manifest: Path, image: str, console: Console) -> None:
        carried.load(manifest, image, console)

    def replicate(self, nodes: Session, specs: Sequence[ContainerSpec], mirror: Path | None,
                  console: Console) -> Replication:
        return Replicator(nodes, specs, mirror, console)

    @contextmanager
    def reach(self, hosts: Sequence[Host], ssh: SSHOptions) -> Iterator[Reached[Session]]:
        reached = self.connect(hosts, ssh, every=False)
        try:
            yield reached
        finally:
            reached.nodes.close()

    def connect(self, hosts: Sequence[Host], ssh: SSHOptions, every: bool) -> Reached[Session]:
        if every:
            nodes = Session.connect(hosts, ssh.accept_new_host_keys)
            return Reached(nodes, nodes.hosts, range(len(nodes.hosts)), {})
        nodes, unreachable = Session.connect_reachable(hosts, ssh.accept_new_host_keys)
        return Reached(nodes, nodes.hosts, nodes.reachable(), unreachable)

    def await_hosts(self, hosts: Sequence[Host], ssh: SSHOptions, console: Console, timeout: float) -> None:
        hostwait.await_hosts(hosts, ssh.accept_new_host_keys, console, timeout)

    def keep(self, nodes: Session, hosts: Sequence[int]) -> Session:
        for i, conn in enumerate(nodes.conns):
            if i not in hosts and conn is not None:
                conn.close()
        return Session([nodes.hosts[i] for i in hosts], [nodes.conns[i] for i in hosts])

    def close(self, nodes: Session) -> None:
        nodes.close()

    def boot_and_driver(self, nodes: Session, rank: int) -> str:
        return hostfiles.boot_and_driver(nodes, rank)

    def channels_held(self, nodes: Session) -> dict[str, int]:
        return {c.host.label: c.peak_channels for c in nodes.conns if c is not None}

    def read_file(self, nodes: Session, host: int, path: str) -> bytes:
        return nodes.conn(host).read_file(path)

    def files_named(self, nodes: Session, host: int, folder: str, prefix: str) -> list[tuple[str, int]]:
        return hostfiles.files_named(nodes, host, folder, prefix)

    def leave_stop_record(self, nodes: Session, job: str) -> dict[str, BaseException | str]:
        return stoprecord.leave(nodes, job)

    def stop_record_seen(self, nodes: Session, job: str) -> bool:
        return stoprecord.seen(nodes, job)

    def clear_stop_record(self, nodes: Session, job: str) -> None:
        stoprecord.clear(nodes, job)

    def cancel(self, nodes: Session, job: str, grace: float, console: Console,
               unreachable: Mapping[str, BaseException | str] | None = None) -> None:
        control.kill_job(nodes, job, grace, console, unreachable)

    def remove(self, nodes: Session, job: str, grace: float, ranks: Sequence[int]) -> None:
        remove_leftovers(nodes, job, grace, ranks)

    def describe(self, nodes: Session, job: str, unreachable: Mapping[str, str]) -> JobStatus:
        return control.describe(nodes, job, unreachable)

    def logs(self, nodes: Session, job: str, node: int | None, tail: int, follow: bool) -> list[NodeLog]:
        return control.node_logs(nodes, job, node, tail, follow)

    def rank_logs(self, nodes: Session, job: str, rank: int, tail: int, follow: bool) -> RankFiles:
        return control.rank_logs(nodes, job, rank, tail, follow)

    def find(self, nodes: Session) -> list[JobRow]:
        return owner.find_jobs(nodes)

    def node_dirs(self, nodes: Session, job: str, mount: str) -> dict[int, tuple[int, str]]:
        return control.job_dirs(nodes, job, mount)

    def node0_dir(self, nodes: Session, job: str, remembered: str | None, mount: str) -> tuple[int, str]:
        return control.node0_dir(nodes, job, remembered, mount)

    # ---- the probe's reads (probe/daemons.py) -----------------------------------------------------------

    def local_image(self, name: str) -> tuple[Local, str | None]:
        return observe.local_image(name)

    def local_layers(self, local: Local, image_id: str | None) -> LocalImage | None:
        # The store is the local daemon's client this scheduler's local_image handed out.
        return observe.local_layers(cast("DockerClient | None", local), image_id)

    def local_platform(self, local: Local, image: str) -> tuple[str, str] | None:
        return observe.local_platform(local, image)

    def address(self, nodes: Session, rank: int) -> str:
        return nodes.conn(rank).peer_address

    def identity(self, nodes: Session, rank: int) -> Identity:
        return nodes.conn(rank).identity()

    def probe_host(self, nodes: Session, rank: int, resources: Resources, master_addr: str, master_ssh_port: int,
                   dirs: dict[str, str]) -> dict[str, str]:
        return hostprobe.probe_host(nodes.conn(rank), resources, rank, master_addr, master_ssh_port, dirs)

    def data_copy_verified(self, nodes: Session, rank: int, folder: str, md5: str) -> bool:
        return has_verified_copy(nodes.conn(rank), folder, md5)

    def daemon_version(self, nodes: Session, rank: int) -> str:
        return str(nodes.docker(rank).server_version)

    def holdings(self, nodes: Session, rank: int, job: str, uid: int) -> Holdings:
        return observe.read_holdings(nodes.docker(rank), job, uid)

    def job_containers(self, nodes: Session, rank: int, job: str, uid: int) -> list[ContainerSeen]:
        return observe.my_containers(nodes.docker(rank), job, uid)

    def image_id(self, nodes: Session, rank: int, image: str) -> str | None:
        return image_id(nodes.docker(rank), image)

    def platforms(self, nodes: Session, ranks: Sequence[int]) -> list[tuple[str, str]]:
        return observe.each_node(nodes, "platform check", ranks, observe.node_platform)

    def chain_ids(self, nodes: Session, ranks: Sequence[int]) -> list[set[str]]:
        return observe.each_node(nodes, "image layers", ranks, observe.node_chain_ids)

    def registry_reach(self, nodes: Session, ranks: Sequence[int], ref: str) -> list[str]:
        return observe.each_node(nodes, "base registry", ranks, lambda client: observe.registry_reach(client, ref))

    def newest_checkpoint(self, nodes: Session, rank: int, folder: str,
                          skipped: Callable[[str], None]) -> Checkpoint | None:
        return newest_valid(nodes.conn(rank), folder, skipped)

    def image_check(self, nodes: Session, spec: ContainerSpec, local: Local) -> str:
        return observe.image_check(nodes, spec, local)
