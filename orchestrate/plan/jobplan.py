"""PURE planning: job config + hosts + the probe's facts → the JobPlan of one attempt. No I/O here.

`build_plan` gives the containers (one NodeSpec per node: what the offline `--dry-run` prints); `plan_job` wraps
them with everything else an attempt does per node (folders, verdicts, image and data actions, leftovers,
resume point). It is built once per attempt, printed by `--dry-run=hosts`, and every later phase reads it.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate import __version__
from orchestrate.config import GPUS_ALL, UpConfig, mask_text, masked_env, secret_values, url_masked
from orchestrate.hosts import Host
from orchestrate.jobs.owner import container_name, owner_labels
from orchestrate.plan import gpus, transport
from orchestrate.probe.checkpoints import Checkpoint
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
class Verdict:
    """One preflight check's result on one node."""

    check: str
    ok: bool
    text: str
    warn: bool = False


@dataclass(frozen=True)
class NodeFacts:
    """What the probe learned about a node and the plan needs (read-only: nothing was changed to learn it)."""

    iface: str | None = None  # interface carrying the master address on this node
    gpus: int | None = None  # GPUs visible on the node (None: not queried)
    home: str | None = None  # the SSH login's home on the node ("~" stays in the dirs until known)
    user: str | None = None  # "uid:gid" of the SSH login: containers run as that user (None: not known yet)
    login: str | None = None  # the login's name, for programs that ask who they are (getpass)
    addr: str | None = None  # the node's address toward the master (its peers see connections from it)
    ib: bool | None = None  # an active InfiniBand/RoCE port and its verbs devices (None: not probed)
    gpu_set: tuple[int, ...] = ()  # the device indices granted here beside the other jobs' (gpuset.py)
    dirs: Mapping[str, str] | None = None  # data/ckpt/log folders resolved by preflight (None: not probed)
    verdicts: tuple[Verdict, ...] = ()  # preflight's checks, in the table's order
    image_id: str | None = None  # the job's image on the node (None: missing)
    layers_held: int = 0  # how many leading layers of the local image the node's daemon holds
    data_present: bool = False  # the data folder holds a verified copy of the data
    leftovers: tuple[str, ...] = ()  # containers of the job found there (removed before the start)


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


@dataclass(frozen=True)
class Attempt:
    """Which start of the job a plan is for: `up`'s own state, never written into the user's config."""

    number: int = 0  # 0: the first start; N: the Nth automatic restart
    cause: str = ""  # how the attempt before ended ("" for the first)
    resume: bool = False  # from the newest checkpoint: the user's --resume, and every restart that found one

    @classmethod
    def first(cls, config: UpConfig) -> Attempt:
        return cls(resume=config.resume)


def build_plan(config: UpConfig, hosts: Sequence[Host], master_addr: str,
               facts: Sequence[NodeFacts] | None = None, launcher: Sequence[str] = ("torchrun",),
               attempt: Attempt | None = None, master_port: int | None = None) -> list[NodeSpec]:
    """One NodeSpec per host, node 0 first. `facts` come from preflight (None for an offline dry run);
    `launcher` from the image check (torchrun, or `python -m torch.distributed.run` where it is not on PATH);
    `attempt` None: the first start; `master_port` the port preflight chose on node 0 (None: --master-port's,
    None too when not given and not probed: shown as detected at launch)."""
    facts = list(facts) if facts is not None else [NodeFacts() for _ in hosts]
    attempt = attempt if attempt is not None else Attempt.first(config)
    nnodes = len(hosts)
    names = tuple((f"ddp-node{rank}", addr) for rank, f in enumerate(facts) if f.addr
                  for addr in ((f.addr, f"::ffff:{f.addr}") if "." in f.addr else (f.addr,)))
    net = transport.job_transport(config.nccl_transport, [f.ib for f in facts]) if not config.cpu_mode else "auto"
    port = master_port if master_port is not None else config.master_port
    return [_with_transport(dataclasses.replace(_node(config, attempt, host, rank, nnodes, master_addr, port,
                                                      facts[rank], tuple(launcher)), extra_hosts=names), net)
            for rank, host in enumerate(hosts)]


def _with_transport(spec: NodeSpec, net: str) -> NodeSpec:
    """IB: the verbs devices and IPC_LOCK (verbs pin memory); sockets: NCCL told to leave IB alone. The user's
    --env still wins over the variable."""
    if net == "ib":
        return dataclasses.replace(spec, devices=(transport.IB_DEVICE_DIR,), cap_add=transport.IB_CAPS)
    if net == "socket":
        return dataclasses.replace(spec, env={**transport.SOCKET_ENV, **spec.env})
    return spec


def _node(config: UpConfig, attempt: Attempt, host: Host, rank: int, nnodes: int, master_addr: str,
          master_port: int | None, facts: NodeFacts, launcher: tuple[str, ...]) -> NodeSpec:
    nproc = nproc_for(config, host, facts)
    iface = host.iface or facts.iface or UNKNOWN
    dirs = dict(facts.dirs) if facts.dirs is not None else host_dirs(config, host, facts.home)
    port = UNKNOWN if master_port is None else str(master_port)
    command = [
        *launcher, "--nnodes", str(nnodes), "--node_rank", str(rank), "--master_addr", master_addr,
        "--master_port", port, "--nproc_per_node", str(nproc), *TORCHRUN_LOG_ARGS,
        *config.entry_argv,
    ]
    if config.is_trainer:
        command += ["--data-dir", DATA_MOUNT, "--ckpt-dir", CKPT_MOUNT, *gpus.trainer_device_args(config.cpu_mode),
                    *config.trainer_args]
        command += ["--resume"] if attempt.resume else []
        # A restart on fewer nodes trains on with the run's global batch (gradient accumulation).
        command += ["--keep-global-batch"] if attempt.number else []
    else:
        command += config.trainer_args
    env = {
        "MASTER_ADDR": master_addr, "MASTER_PORT": port, "NODE_RANK": str(rank),
        "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "GLOO_SOCKET_IFNAME": iface,
        "DDP_CIFAR_JOB": config.job,
        # The contract with any program (docs/DESIGN.md §7); torchrun adds RANK, LOCAL_RANK, WORLD_SIZE.
        ENV_DATA_DIR: DATA_MOUNT, ENV_CKPT_DIR: CKPT_MOUNT, ENV_LOG_DIR: LOG_MOUNT, **user_env(facts),
    }
    if attempt.resume:
        env[ENV_RESUME] = "1"
    if attempt.number:  # the trainer records it in metrics.jsonl (docs/DESIGN.md §7)
        env.update({ENV_RESTART: str(attempt.number), ENV_RESTART_CAUSE: attempt.cause})
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
                RESTART_LABEL: str(attempt.number), RESTART_CAUSE_LABEL: attempt.cause,
                **owner_labels(facts.user, facts.login), **_claim_labels(rank, facts.gpu_set, master_port)},
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


# ---- the JobPlan: one attempt, every node, everything it does -------------------------------------------


@dataclass(frozen=True)
class LocalImage:
    """The job's image on this machine, as the plan needs it (None in the plan: no local image)."""

    id: str
    diff_ids: tuple[str, ...]  # its layers (RootFS), oldest first
    sizes: tuple[int, ...] | None  # each layer's uncompressed size, oldest first (None: not known)

    @property
    def layers(self) -> int:
        return len(self.diff_ids)


@dataclass(frozen=True)
class ImageAction:
    """What the node gets of the image: "present" (nothing), "send" (the layers it lacks) or "pull"."""

    kind: str
    layers: int = 0  # the image's layers ("send")
    layers_held: int = 0  # leading layers the node holds already: not sent
    bytes: int | None = None  # uncompressed size of the layers sent (None: not known); sent compressed

    @property
    def layers_sent(self) -> int:
        return self.layers - self.layers_held if self.kind == "send" else 0


@dataclass(frozen=True)
class DataAction:
    """What the node's data folder gets: "present" (a verified copy: nothing), "download" (on the node, from
    `source`), "send" (the archive `source` from here), "sync" (the folder or file `source`, incrementally) or
    "none" (another program finds its data itself). Nodes whose folders are one shared folder (NFS) are found
    when the data is applied (it takes writing a file there): one of them fetches, the others share it."""

    kind: str
    source: str = ""  # the URL (password masked) or the local path
    bytes: int | None = None  # the archive's size ("send")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint the attempt starts from: the newest valid one on any node."""

    checkpoint: Checkpoint
    source: int  # the node that holds it
    copy_to: tuple[int, ...]  # nodes that lack it: it is copied there before the start


@dataclass(frozen=True)
class NodePlan:
    rank: int
    host: Host
    dirs: Mapping[str, str]  # data/ckpt/log folders on the host, ~ resolved
    verdicts: tuple[Verdict, ...]
    image: ImageAction
    data: DataAction
    leftovers: tuple[str, ...]  # containers of the job there, removed before the start
    container: NodeSpec


@dataclass(frozen=True)
class JobPlan:
    """Everything one attempt of `up` does, per node; built once, then only read."""

    job: str
    attempt: Attempt
    master: str  # address:port of the rendezvous
    launcher: tuple[str, ...] | None  # None: with --pull, read from the image once node 0 pulled it
    resume: ResumePoint | None
    nodes: tuple[NodePlan, ...]

    @property
    def specs(self) -> list[NodeSpec]:
        return [n.container for n in self.nodes]

    def with_launcher(self, launcher: Sequence[str]) -> JobPlan:
        """The plan whose launcher the image check found after a pull: only the command's head changes."""
        old = len(self.nodes[0].container.command) - len(_after_launcher(self.nodes[0].container))
        nodes = tuple(dataclasses.replace(n, container=dataclasses.replace(
            n.container, command=(*launcher, *n.container.command[old:]))) for n in self.nodes)
        return dataclasses.replace(self, launcher=tuple(launcher), nodes=nodes)


    def with_claim(self, specs: Sequence[NodeSpec], port: int | None) -> JobPlan:
        """The plan as a lost GPU/port claim re-planned it (apply/claim.py): other GPU sets or another port."""
        nodes = tuple(dataclasses.replace(n, container=spec) for n, spec in zip(self.nodes, specs, strict=True))
        return dataclasses.replace(self, master=f"{self.master.rsplit(':', 1)[0]}:{port}", nodes=nodes)


def _after_launcher(spec: NodeSpec) -> tuple[str, ...]:
    return spec.command[spec.command.index("--nnodes"):]


def image_action(config: UpConfig, local: LocalImage | None, node: NodeFacts) -> ImageAction:
    """PURE: the same ID is there: nothing; else pulled (--pull) or its missing layers sent. Without a local
    image preflight passes only where the node holds it."""
    if config.pull:
        missing = node.image_id is None or (local is not None and node.image_id != local.id)
        return ImageAction("pull" if missing else "present")
    if local is None or node.image_id == local.id:
        return ImageAction("present")
    held = min(node.layers_held, local.layers)
    size = sum(local.sizes[held:]) if local.sizes is not None else None
    return ImageAction("send", local.layers, held, size)


def data_action(config: UpConfig, node: NodeFacts, archive_bytes: int | None, from_folder: bool) -> DataAction:
    """PURE: CIFAR-10 is the trainer's data (downloaded, or its archive sent, unless a verified copy is there);
    a folder of --data-from (or, for another program, a single file) is synced; else nothing."""
    if config.data_from is not None and (from_folder or not config.is_trainer):
        return DataAction("sync", str(config.data_from))
    if not config.is_trainer:
        return DataAction("none")
    if node.data_present:
        return DataAction("present")
    if config.data_from is not None:
        return DataAction("send", str(config.data_from), archive_bytes)
    return DataAction("download", url_masked(config.data_url))


def plan_job(config: UpConfig, attempt: Attempt, hosts: Sequence[Host], master_addr: str,
             facts: Sequence[NodeFacts], local: LocalImage | None, launcher: Sequence[str] | None,
             resume: ResumePoint | None, archive_bytes: int | None = None, from_folder: bool = False,
             master_port: int | None = None) -> JobPlan:
    """PURE: the attempt's plan from the config, the hosts and what the probe found (the facts of every node and
    of this machine: the local image, the --data-from archive's size or whether it is a folder)."""
    specs = build_plan(config, hosts, master_addr, facts, launcher or ("torchrun",), attempt, master_port)
    nodes = tuple(NodePlan(rank, spec.host, spec.dirs, f.verdicts, image_action(config, local, f),
                           data_action(config, f, archive_bytes, from_folder), f.leftovers, spec)
                  for rank, (spec, f) in enumerate(zip(specs, facts, strict=True)))
    port = master_port if master_port is not None else config.master_port
    return JobPlan(config.job, attempt, f"{master_addr}:{port}",
                   tuple(launcher) if launcher is not None else None, resume, nodes)


def render_job_plan(plan: JobPlan) -> str:
    """The plan as text, secrets masked: per node its folders, actions and `docker run` line."""
    a = plan.attempt
    lines = [f"# job {plan.job}: attempt {a.number}" + (f" ({a.cause})" if a.cause else "")
             + f", {len(plan.nodes)} node(s), master {plan.master}"]
    if plan.resume is not None:
        c = plan.resume.checkpoint
        lines.append(f"# resume: step {c.step} (epoch {c.epoch}) from node {plan.resume.source}:{c.path}"
                     + (f", copied to node(s) {', '.join(map(str, plan.resume.copy_to))}" if plan.resume.copy_to
                        else ""))
    if plan.launcher is None:
        lines.append("# launcher: read from the image once node 0 pulled it (torchrun shown)")
    for n in plan.nodes:
        lines.append(f"# node {n.rank} on {n.host.label}: container {n.container.name}")
        lines.append("#   dirs: " + ", ".join(f"{k} {v}" for k, v in n.dirs.items()))
        lines.append(f"#   image: {_image_text(n.image)}")
        lines.append(f"#   data: {_data_text(n.data)}")
        lines.append("#   leftovers removed: " + (", ".join(n.leftovers) or "none"))
        lines.append("#   checks: " + ", ".join(f"{v.check} {'ok' if v.ok else 'FAILED'} ({v.text})"
                                                for v in n.verdicts))
        lines.append(shlex.join(n.container.docker_run_argv()))
    return "\n".join(lines)


def _image_text(action: ImageAction) -> str:
    if action.kind != "send":
        return {"present": "present, nothing sent", "pull": "pulled"}[action.kind]
    size = f", {action.bytes / 1e6:.1f} MB uncompressed" if action.bytes is not None else ""
    return f"send {action.layers_sent} of {action.layers} layers{size}"


def _data_text(action: DataAction) -> str:
    return {"present": "verified copy present, nothing moved", "download": f"downloaded on the node from {action.source}",
            "send": f"archive {action.source} sent ({action.bytes} bytes)", "sync": f"{action.source} synced",
            "none": "nothing (the program finds its data)"}[action.kind]


def plan_json(plan: JobPlan) -> dict[str, Any]:
    """The plan as JSON-ready data (docs/orchestrate.md, "The plan as JSON"), secrets masked."""
    resume = None
    if plan.resume is not None:
        c = plan.resume.checkpoint
        resume = {"step": c.step, "epoch": c.epoch, "node": plan.resume.source, "path": c.path,
                  "copy_to": list(plan.resume.copy_to)}
    return {"form": "hosts", "job": plan.job, "master": plan.master,
            "attempt": dataclasses.asdict(plan.attempt), "launcher": list(plan.launcher) if plan.launcher else None,
            "resume": resume, "nodes": [_node_json(n) for n in plan.nodes]}


def _node_json(node: NodePlan) -> dict[str, Any]:
    image = {**dataclasses.asdict(node.image), "layers_sent": node.image.layers_sent}
    return {"rank": node.rank, "host": node.host.label, "dirs": dict(node.dirs),
            "checks": [dataclasses.asdict(v) for v in node.verdicts], "image": image,
            "data": dataclasses.asdict(node.data), "leftovers": list(node.leftovers),
            **container_json(node.container)}


def container_json(spec: NodeSpec) -> dict[str, Any]:
    """The container's Docker SDK arguments (environment masked) and the same as a `docker run` line."""
    secrets = secret_values(spec.env)
    kwargs = {**spec.sdk_kwargs(), "environment": masked_env(spec.env),
              "command": [mask_text(a, secrets) for a in spec.command]}
    return {"container": {k: v for k, v in kwargs.items() if k != "detach"}, "docker_run": spec.docker_run_argv()}


def offline_json(specs: Sequence[NodeSpec]) -> dict[str, Any]:
    """The offline `--dry-run` as JSON: the containers only (nothing was probed)."""
    return {"form": "offline", "nodes": [{"rank": s.rank, "host": s.host.label, **container_json(s)}
                                         for s in specs]}
