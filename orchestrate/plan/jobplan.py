"""PURE planning: job config + hosts + preflight facts → one NodeSpec per node. No I/O here.

The plan is what `--dry-run` prints and what unit tests assert; launch only applies it.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate import __version__
from orchestrate.config import GPUS_ALL, UpConfig, mask_text, masked_env, secret_values
from orchestrate.hosts import Host
from orchestrate.jobs.owner import container_name, owner_labels
from orchestrate.plan import gpus, transport
from orchestrate.remote.docker import (
    GPUS_LABEL,
    JOB_LABEL,
    NNODES_LABEL,
    PORT_LABEL,
    RANK_LABEL,
    RESTART_CAUSE_LABEL,
    RESTART_LABEL,
    VERSION_LABEL,
)
from trainer.contract import (
    ENV_CKPT_DIR,
    ENV_DATA_DIR,
    ENV_LOG_DIR,
    ENV_RESTART,
    ENV_RESTART_CAUSE,
    ENV_RESUME,
    FR_DUMP_PREFIX,
)

DATA_MOUNT = "/data"
CKPT_MOUNT = "/checkpoints"
LOG_MOUNT = "/logs"
UNKNOWN = "<detected at launch>"
# Every rank's stdout and stderr into files under the log mount, and still to the console (docker logs).
# torchrun writes <log-dir>/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log.
TORCHRUN_LOG_ARGS = ("--log-dir", LOG_MOUNT, "--redirects", "3", "--tee", "3")
# NGC's recommended limits for GPU containers: unlimited locked memory (pinned buffers for NCCL/RDMA) and a
# 64 MB stack. CPU mode needs no pinned memory, and a daemon whose own memlock limit is capped (rootless or
# sandboxed Docker) refuses memlock=-1 outright, so CPU mode sets the stack only.
GPU_ULIMITS = (("memlock", -1, -1), ("stack", 67108864, 67108864))
CPU_ULIMITS = (("stack", 67108864, 67108864),)


@dataclass(frozen=True)
class NodeFacts:
    """What preflight learned about a node and the plan needs."""

    iface: str | None = None  # interface carrying the master address on this node
    gpus: int | None = None  # GPUs visible on the node (None: not queried)
    home: str | None = None  # the SSH login's home on the node ("~" stays in the dirs until known)
    user: str | None = None  # "uid:gid" of the SSH login: containers run as that user (None: not known yet)
    login: str | None = None  # the login's name, for programs that ask who they are (getpass)
    addr: str | None = None  # the node's address toward the master (its peers see connections from it)
    ib: bool | None = None  # an active InfiniBand/RoCE port and its verbs devices (None: not probed)
    gpu_set: tuple[int, ...] = ()  # the device indices granted here beside the other jobs' (gpuset.py)


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class NodeSpec:
    """One container to start on one host."""

    rank: int
    host: Host
    name: str
    image: str
    command: tuple[str, ...]
    env: dict[str, str]
    mounts: tuple[Mount, ...]
    labels: dict[str, str]
    gpus: int  # 0: none; GPUS_ALL: every GPU; N: that many (or len(gpu_ids))
    ipc_mode: str | None
    shm_size: str | None
    memory: str | None = None  # the container's memory limit (docker run --memory); None: the host's memory
    ulimits: tuple[tuple[str, int, int], ...] = ()
    init: bool = True
    network_mode: str = "host"
    dirs: dict[str, str] = field(default_factory=dict)  # data/ckpt/log dirs on the host
    user: str | None = None  # "uid:gid" the container runs as (the SSH login's, so files in the dirs are theirs)
    # (name, address) of every node: c10d looks up the name of each peer's address (getnameinfo) and warns on
    # every connection when none is found (hosts without reverse DNS); /etc/hosts entries answer it. An IPv4
    # address also as IPv4-mapped IPv6: TCPStore's dual-stack socket sees peers as ::ffff:a.b.c.d.
    extra_hosts: tuple[tuple[str, str], ...] = ()
    gpu_ids: tuple[int, ...] = ()  # these device indices instead of the first `gpus`
    devices: tuple[str, ...] = ()  # host device nodes or folders of them (InfiniBand)
    cap_add: tuple[str, ...] = ()

    def docker_run_argv(self) -> list[str]:
        """What --dry-run prints: the `docker run` command line rendered from sdk_kwargs(), the very arguments
        launch applies (each key has its flag; a key without one is a bug, not silently left out), with every
        secret's value masked wherever it appears."""
        kwargs = {**self.sdk_kwargs(), "environment": masked_env(self.env)}
        argv = ["docker", "run"]
        for key, value in kwargs.items():
            if key not in ("image", "command"):
                argv += _RUN_FLAGS[key](value)
        argv += [kwargs["image"], *kwargs["command"]]
        return [mask_text(a, secret_values(self.env)) for a in argv]

    def sdk_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for docker-py's containers.run / create."""
        import docker.types  # the SDK types are plain data; imported here to keep the plan import light

        requests = []
        if self.gpus:
            requests.append(docker.types.DeviceRequest(**gpus.device_request(self.gpus, self.gpu_ids)))
        return dict(
            image=self.image, command=list(self.command), name=self.name, detach=True,
            environment=dict(self.env), labels=dict(self.labels), network_mode=self.network_mode,
            init=self.init, ipc_mode=self.ipc_mode, shm_size=self.shm_size, device_requests=requests or None,
            # No swap beyond the limit: with swap the container could take twice as much, slowly.
            mem_limit=self.memory, memswap_limit=self.memory,
            ulimits=[docker.types.Ulimit(name=n, soft=s, hard=h) for n, s, h in self.ulimits],
            mounts=[docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
                    for m in self.mounts],
            privileged=False, stop_signal="SIGTERM", user=self.user, extra_hosts=[f"{name}:{addr}" for name, addr in self.extra_hosts] or None,
            devices=list(self.devices) or None, cap_add=list(self.cap_add) or None,
        )


def _mount_flag(mount: Any) -> list[str]:
    # --mount, not --volume: a bind mount of a missing folder fails instead of creating it as root.
    ro = ",readonly" if mount.get("ReadOnly") else ""
    return [f"--mount=type={mount['Type']},source={mount['Source']},target={mount['Target']}{ro}"]


# docker-py's run() keyword → the `docker run` flags that mean the same (docs.docker.com, "docker run").
_RUN_FLAGS: dict[str, Callable[[Any], list[str]]] = {
    "name": lambda v: ["--name", v],
    "detach": lambda v: ["--detach"] if v else [],
    "network_mode": lambda v: [f"--network={v}"],
    "user": lambda v: [f"--user={v}"] if v else [],
    "init": lambda v: ["--init"] if v else [],
    "ipc_mode": lambda v: [f"--ipc={v}"] if v else [],
    "shm_size": lambda v: [f"--shm-size={v}"] if v else [],
    "mem_limit": lambda v: [f"--memory={v}"] if v else [],
    "memswap_limit": lambda v: [f"--memory-swap={v}"] if v else [],
    "device_requests": gpus.gpus_flag,
    "ulimits": lambda v: [f"--ulimit={u['Name']}={u['Soft']}:{u['Hard']}" for u in v],
    "extra_hosts": lambda v: [f"--add-host={entry}" for entry in v or ()],
    "labels": lambda v: [f"--label={k}={x}" for k, x in v.items()],
    "environment": lambda v: [f"--env={k}={x}" for k, x in v.items()],
    "mounts": lambda v: [flag for m in v for flag in _mount_flag(m)],
    "privileged": lambda v: ["--privileged"] if v else [],
    "stop_signal": lambda v: [f"--stop-signal={v}"],
    "devices": lambda v: [f"--device={d}" for d in v or ()],
    "cap_add": lambda v: [f"--cap-add={c}" for c in v or ()],
}


def host_dirs(config: UpConfig, host: Host, home: str | None = None) -> dict[str, str]:
    """The data/checkpoint/log dirs on a host: hosts-file keys win over the command line; {job} expands, and a
    leading ~ becomes the login's home on that host once known (the defaults are per user, never a shared
    world-writable folder another account could have made first)."""
    chosen = {"data": host.data_dir or config.data_dir, "ckpt": host.ckpt_dir or config.ckpt_dir,
              "log": host.log_dir or config.log_dir}
    dirs = {k: v.replace("{job}", config.job) for k, v in chosen.items()}
    if home is not None:
        dirs = {k: home.rstrip("/") + v[1:] if v == "~" or v.startswith("~/") else v for k, v in dirs.items()}
    return dirs


def user_env(facts: NodeFacts) -> dict[str, str]:
    """What a program needs to run as an arbitrary uid: a writable HOME (the image's is root's), and the name
    getpass and torch's cache paths ask for (a uid of the host has no entry in the image's /etc/passwd)."""
    if facts.user is None or facts.user.startswith("0:"):
        return {}
    env = {"HOME": "/tmp"}
    if facts.login:
        env |= {"USER": facts.login, "LOGNAME": facts.login}
    return env


def nproc_for(config: UpConfig, host: Host, facts: NodeFacts) -> int | str:
    if config.nproc_per_node is not None:
        return config.nproc_per_node
    if facts.gpu_set:  # one process per GPU granted, on CPU too (--gpus-on-cpu)
        return len(facts.gpu_set)
    if config.cpu_mode:
        return host.slots or 1
    if config.gpus > 0:
        return min(config.gpus, host.slots) if host.slots else config.gpus
    if facts.gpus is not None:
        return min(facts.gpus, host.slots) if host.slots else facts.gpus
    return host.slots or UNKNOWN


def build_plan(config: UpConfig, hosts: Sequence[Host], master_addr: str,
               facts: Sequence[NodeFacts] | None = None, launcher: Sequence[str] = ("torchrun",)) -> list[NodeSpec]:
    """One NodeSpec per host, node 0 first. `facts` come from preflight (None for an offline dry run);
    `launcher` from the image check (torchrun, or `python -m torch.distributed.run` where it is not on PATH)."""
    facts = list(facts) if facts is not None else [NodeFacts() for _ in hosts]
    nnodes = len(hosts)
    names = tuple((f"ddp-node{rank}", addr) for rank, f in enumerate(facts) if f.addr
                  for addr in ((f.addr, f"::ffff:{f.addr}") if "." in f.addr else (f.addr,)))
    net = transport.job_transport(config.nccl_transport, [f.ib for f in facts]) if not config.cpu_mode else "auto"
    return [_with_transport(dataclasses.replace(_node(config, host, rank, nnodes, master_addr, facts[rank],
                                                      tuple(launcher)), extra_hosts=names), net)
            for rank, host in enumerate(hosts)]


def _with_transport(spec: NodeSpec, net: str) -> NodeSpec:
    """IB: the verbs devices and IPC_LOCK (verbs pin memory); sockets: NCCL told to leave IB alone. The user's
    --env still wins over the variable."""
    if net == "ib":
        return dataclasses.replace(spec, devices=(transport.IB_DEVICE_DIR,), cap_add=transport.IB_CAPS)
    if net == "socket":
        return dataclasses.replace(spec, env={**transport.SOCKET_ENV, **spec.env})
    return spec


def _node(config: UpConfig, host: Host, rank: int, nnodes: int, master_addr: str, facts: NodeFacts,
          launcher: tuple[str, ...]) -> NodeSpec:
    nproc = nproc_for(config, host, facts)
    iface = host.iface or facts.iface or UNKNOWN
    dirs = host_dirs(config, host, facts.home)
    port = UNKNOWN if config.master_port is None else str(config.master_port)
    command = [
        *launcher, "--nnodes", str(nnodes), "--node_rank", str(rank), "--master_addr", master_addr,
        "--master_port", port, "--nproc_per_node", str(nproc), *TORCHRUN_LOG_ARGS,
        *config.entry_argv,
    ]
    if config.is_trainer:
        command += ["--data-dir", DATA_MOUNT, "--ckpt-dir", CKPT_MOUNT, *gpus.trainer_device_args(config.cpu_mode),
                    *config.trainer_args]
        command += ["--resume"] if config.resume else []
        # A restart on fewer nodes trains on with the run's global batch (gradient accumulation).
        command += ["--keep-global-batch"] if config.restart else []
    else:
        command += config.trainer_args
    env = {
        "MASTER_ADDR": master_addr, "MASTER_PORT": port, "NODE_RANK": str(rank),
        "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "GLOO_SOCKET_IFNAME": iface,
        "DDP_CIFAR_JOB": config.job,
        # The contract with any program (docs/DESIGN.md §7); torchrun adds RANK, LOCAL_RANK, WORLD_SIZE.
        ENV_DATA_DIR: DATA_MOUNT, ENV_CKPT_DIR: CKPT_MOUNT, ENV_LOG_DIR: LOG_MOUNT, **user_env(facts),
    }
    if config.resume:
        env[ENV_RESUME] = "1"
    if config.restart:  # the trainer records it in metrics.jsonl (docs/DESIGN.md §7)
        env.update({ENV_RESTART: str(config.restart), ENV_RESTART_CAUSE: config.restart_cause})
    if not config.cpu_mode:
        env["NCCL_SOCKET_IFNAME"] = iface
        # The image's TORCH_NCCL_ASYNC_ERROR_HANDLING=3 stays (tear down on a failed collective, with the flight
        # recorder dumped first; 1 would skip the dump). The dumps go to the node's log dir, not the container's
        # /tmp that goes away with it.
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{LOG_MOUNT}/{FR_DUMP_PREFIX}"
    env.update(_simulated_devices(config, facts.gpu_set))
    env.update(config.env_dict)  # the user's --env last: it may override the defaults on purpose
    ids = facts.gpu_set or config.gpu_ids
    n_gpus = 0 if config.cpu_mode else len(ids) if ids else config.gpus if config.gpus > 0 else host.slots or GPUS_ALL
    return NodeSpec(
        rank=rank, host=host, name=container_name(config.job, rank, facts.login), image=config.image, command=tuple(command),
        env=env,
        mounts=(Mount(dirs["data"], DATA_MOUNT, read_only=True), Mount(dirs["ckpt"], CKPT_MOUNT),
                Mount(dirs["log"], LOG_MOUNT)),
        labels={JOB_LABEL: config.job, RANK_LABEL: str(rank), NNODES_LABEL: str(nnodes), VERSION_LABEL: __version__,
                RESTART_LABEL: str(config.restart), RESTART_CAUSE_LABEL: config.restart_cause,
                **owner_labels(facts.user, facts.login), **_claim_labels(rank, facts.gpu_set, config.master_port)},
        gpus=n_gpus, gpu_ids=ids, ipc_mode=None if config.shm_size else "host", shm_size=config.shm_size,
        memory=config.memory, dirs=dirs,
        ulimits=CPU_ULIMITS if config.cpu_mode else GPU_ULIMITS, user=facts.user,
    )


def _claim_labels(rank: int, gpu_set: tuple[int, ...], port: int | None) -> dict[str, str]:
    """The GPU set every container holds, and node 0's master port: what the next job's preflight reads."""
    labels = {GPUS_LABEL: gpus.gpus_text(gpu_set)} if gpu_set else {}
    if rank == 0 and port is not None:
        labels[PORT_LABEL] = str(port)
    return labels


def _simulated_devices(config: UpConfig, gpu_set: tuple[int, ...]) -> dict[str, str]:
    """--gpus-on-cpu: what a container on a GPU node sees without a DeviceRequest to make it so. Docker's NVIDIA
    device driver sets NVIDIA_VISIBLE_DEVICES to the requested device IDs (moby daemon/nvidia_linux.go); CUDA in
    the container then numbers those GPUs 0..k-1. On a real GPU node neither is set here: Docker does it."""
    if not (config.gpus_on_cpu and gpu_set):
        return {}
    return {"NVIDIA_VISIBLE_DEVICES": gpus.gpus_text(gpu_set),
            "CUDA_VISIBLE_DEVICES": gpus.gpus_text(range(len(gpu_set)))}


def render_plan(specs: Sequence[NodeSpec]) -> str:
    """Human-readable plan, secrets masked: per node, the container and its full arguments."""
    lines: list[str] = []
    for spec in specs:
        lines.append(f"# node {spec.rank} on {spec.host.label} ({spec.host.source}): container {spec.name}")
        lines.append(shlex.join(spec.docker_run_argv()))
    return "\n".join(lines)
