"""PURE planning: one attempt's PlanInputs (the config sections it reads + hosts + the probe's facts) → its JobPlan.
No I/O here. Each function takes the sections it reads (Program, Resources, Where...) or the PlanInputs, never the
whole UpConfig.

`container_specs` gives the containers (one ContainerSpec per node: what the offline `--dry-run` prints); `plan_job` wraps
them with everything else an attempt does per node (folders, verdicts, image and data actions, leftovers,
resume point). It is built once per attempt, printed by `--dry-run=hosts`, and every later phase reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrate.config import Data, Delivery, Program, Resilience, Resources, Where
from orchestrate.errors import ConfigError
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.labels import (
    GPUS_LABEL,
    JOB_LABEL,
    NNODES_LABEL,
    PORT_LABEL,
    RANK_LABEL,
    RESTART_CAUSE_LABEL,
    RESTART_LABEL,
    VERSION_LABEL,
    container_name,
    owner_labels,
)
from orchestrate.masking import url_masked
from orchestrate.plan import gpus, gpuset, transport
from orchestrate.plan.resume import ResumePoint
from orchestrate.probe.observations import TORCHRUN, CheckResult, Launcher, LocalImage, NodeFacts, lacks_base
from orchestrate.version import __version__
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
class Mount:
    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerSpec:
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
    entrypoint: tuple[str, ...] = ()  # the image's own unless given (a short container: plan/shortlived.py)


def host_dirs(where: Where, job: str, host: Host, home: str | None = None) -> dict[str, str]:
    """The data/checkpoint/log dirs on a host: hosts-file keys win over the command line; {job} expands, and a
    leading ~ becomes the login's home on that host once known (the defaults are per user, never a shared
    world-writable folder another account could have made first)."""
    chosen = {"data": host.data_dir or where.data_dir, "ckpt": host.ckpt_dir or where.ckpt_dir,
              "log": host.log_dir or where.log_dir}
    dirs = {k: v.replace("{job}", job) for k, v in chosen.items()}
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


def gpu_set(resources: Resources, host: Host, facts: NodeFacts) -> gpuset.GpuSet:
    """The GPUs the node gets, and why (plan/gpuset.py's decide_gpus, from the node's observations)."""
    return gpuset.decide_gpus(resources, host, facts.gpu, facts.holdings)


def nproc_for(resources: Resources, host: Host, facts: NodeFacts) -> int | str:
    if resources.nproc_per_node is not None:
        return resources.nproc_per_node
    held = gpu_set(resources, host, facts)
    if held.held:  # one process per GPU granted, on CPU too (hosts whose GPUs are CPU stand-ins)
        return len(held.ids)
    if resources.cpu_mode:
        return host.slots or 1
    if host.gpu_ids:  # the line's own grant is what preflight will grant (the offline dry run has no facts)
        return len(host.gpu_ids)
    if resources.gpus > 0:
        return min(resources.gpus, host.slots) if host.slots else resources.gpus
    if facts.gpus is not None:
        return min(facts.gpus, host.slots) if host.slots else facts.gpus
    return host.slots or UNKNOWN


def pipeline_layout(pp: int, nprocs: Sequence[int | str]) -> str:
    """What the trainer's --pp makes of this world, in one line; a ConfigError when the processes of all nodes do not
    divide by it (the trainer would refuse at start, on every node). Ranks fill node 0 first and the (pp x dp) mesh
    has pp outermost, so with one replica per node's worth of processes, stage s lies on node s."""
    if pp == 1:
        return ""
    counts = [n for n in nprocs if isinstance(n, int)]
    if len(counts) < len(nprocs):
        return f"# pipeline: --pp {pp}; the processes per node are detected at launch, and must divide by {pp}"
    world = sum(counts)
    if world % pp:
        raise ConfigError(f"trainer option --pp {pp}: {len(counts)} node(s) x processes per node = {world} processes, "
                          f"not divisible by {pp}; change --pp, the hosts or --nproc-per-node")
    dp = world // pp
    return (f"# pipeline: --pp {pp} over {world} processes: {pp} stages x {dp} data-parallel replicas; stage s on "
            f"ranks s*{dp} .. s*{dp}+{dp - 1}")


def refuse_uneven_fsdp(program: Program, nprocs: Sequence[tuple[Host, int | str]]) -> None:
    """--strategy fsdp on nodes whose known process counts differ: refused in one line before anything starts.
    HSDP shards within a node, which needs every node alike; the trainer would fall back to flat FSDP over
    every process (its ranks agree on that from every rank's count), sending every all-gather across nodes."""
    known = {n for _, n in nprocs if isinstance(n, int)}
    if len(known) < 2 or not program.is_trainer or not _fsdp_words(program.trainer_args):
        return
    counts = ", ".join(f"{host.name}: {n}" for host, n in nprocs)
    raise ConfigError(f"--strategy fsdp needs the same number of processes on every node, and these differ "
                      f"({counts}); give every host the same slots=/gpu_ids= or --nproc-per-node, or use "
                      "--strategy ddp")


def _fsdp_words(args: Sequence[str]) -> bool:
    """The trainer's --strategy is fsdp (the last one given wins, as in argparse)."""
    chosen = "ddp"
    for i, word in enumerate(args):
        if word == "--strategy" and i + 1 < len(args):
            chosen = args[i + 1]
        elif word.startswith("--strategy="):
            chosen = word.partition("=")[2]
    return chosen == "fsdp"


@dataclass(frozen=True)
class Attempt:
    """Which start of the job a plan is for: `up`'s own state, never written into the user's config."""

    number: int = 0  # 0: the first start; N: the Nth automatic restart
    cause: str = ""  # how the attempt before ended ("" for the first)
    resume: bool = False  # from the newest checkpoint: the user's --resume, and every restart that found one

    @classmethod
    def first(cls, resilience: Resilience) -> Attempt:
        return cls(resume=resilience.resume)


@dataclass(frozen=True)
class PlanInputs:
    """Everything an attempt's plan is made from, built once by the pipeline: the config's sections it reads, the
    attempt, the hosts, and what the probe observed (each node's facts, this machine's image and --data-from) with
    preflight's verdicts. An offline dry run has only the sections and the hosts: the rest keeps its default."""

    program: Program
    resources: Resources
    where: Where
    data: Data
    delivery: Delivery
    attempt: Attempt
    hosts: tuple[Host, ...]
    master_addr: str
    facts: tuple[NodeFacts, ...] | None = None  # from preflight (None: an offline dry run)
    local: LocalImage | None = None  # the job's image on this machine (None: none)
    # The image's launchers, from the image check (None: with --pull, read from the image once node 0 pulled it;
    # the containers say torchrun until then)
    launcher: Launcher | None = None
    resume: ResumePoint | None = None
    archive_bytes: int | None = None  # the --data-from archive's size
    from_folder: bool = False  # --data-from is a folder
    master_port: int | None = None  # the port preflight chose on node 0 (None: --master-port's)
    verdicts: tuple[tuple[CheckResult, ...], ...] | None = None  # preflight's on each node (None: none made)

    @property
    def node_facts(self) -> tuple[NodeFacts, ...]:
        """Each node's facts; nothing known of any (shown as detected at launch) before preflight."""
        return self.facts if self.facts is not None else tuple(NodeFacts() for _ in self.hosts)

    @property
    def port(self) -> int | None:
        """The rendezvous port: preflight's, else --master-port's (None: detected at launch)."""
        return self.master_port if self.master_port is not None else self.where.master_port


def launch_head(launcher: Launcher | None, nprocs: Sequence[int | str]) -> tuple[str, ...]:
    """PURE: what starts each node's processes. Where every node runs one process and the image has it,
    trainer.launch: torchrun's agent would import torch (a CPU-second and about a second of every node start) to
    supervise one process that the container's init and the watcher supervise already. Otherwise torchrun: its
    rendezvous numbers the ranks of nodes with different process counts, which every node must then join."""
    if launcher is None:
        return TORCHRUN
    return launcher.one_process if launcher.one_process and all(n == 1 for n in nprocs) else launcher.torchrun


def container_specs(inputs: PlanInputs) -> list[ContainerSpec]:
    """One ContainerSpec per host, node 0 first."""
    facts = inputs.node_facts
    nprocs = [(host, nproc_for(inputs.resources, host, f)) for host, f in zip(inputs.hosts, facts, strict=True)]
    refuse_uneven_fsdp(inputs.program, nprocs)
    head = launch_head(inputs.launcher, [n for _, n in nprocs])
    names = tuple((f"ddp-node{rank}", addr) for rank, f in enumerate(facts) if f.addr
                  for addr in ((f.addr, f"::ffff:{f.addr}") if "." in f.addr else (f.addr,)))
    resources = inputs.resources
    net = transport.job_transport(resources.nccl_transport, [f.ib for f in facts]) if not resources.cpu_mode else "auto"
    return [_with_transport(dataclasses.replace(_node(inputs, rank, head), extra_hosts=names), net)
            for rank in range(len(inputs.hosts))]


def _with_transport(spec: ContainerSpec, net: str) -> ContainerSpec:
    """IB: the verbs devices and IPC_LOCK (verbs pin memory); sockets: NCCL told to leave IB alone. The user's
    --env still wins over the variable."""
    if net == "ib":
        return dataclasses.replace(spec, devices=(transport.IB_DEVICE_DIR,), cap_add=transport.IB_CAPS)
    if net == "socket":
        return dataclasses.replace(spec, env={**transport.SOCKET_ENV, **spec.env})
    return spec


def _node(inputs: PlanInputs, rank: int, head: tuple[str, ...]) -> ContainerSpec:
    program, resources, attempt = inputs.program, inputs.resources, inputs.attempt
    host, facts, nnodes, master_addr = inputs.hosts[rank], inputs.node_facts[rank], len(inputs.hosts), inputs.master_addr
    master_port = inputs.port
    nproc = nproc_for(resources, host, facts)
    iface = host.iface or facts.iface or UNKNOWN
    dirs = dict(facts.dirs) if facts.dirs is not None else host_dirs(inputs.where, program.job, host, facts.home)
    port = UNKNOWN if master_port is None else str(master_port)
    command = [
        *head, "--nnodes", str(nnodes), "--node_rank", str(rank), "--master_addr", master_addr,
        "--master_port", port, "--nproc_per_node", str(nproc), *TORCHRUN_LOG_ARGS,
        *program.entry_argv,
    ]
    if program.is_trainer:
        command += ["--data-dir", DATA_MOUNT, "--ckpt-dir", CKPT_MOUNT, *gpus.trainer_device_args(resources.cpu_mode),
                    *program.trainer_args]
        command += ["--resume"] if attempt.resume else []
        # A restart on fewer nodes trains on with the run's global batch (gradient accumulation).
        command += ["--keep-global-batch"] if attempt.number else []
    else:
        command += program.trainer_args
    env = {
        "MASTER_ADDR": master_addr, "MASTER_PORT": port, "NODE_RANK": str(rank),
        "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "GLOO_SOCKET_IFNAME": iface,
        "DDP_CIFAR_JOB": program.job,
        # The contract with any program (docs/DESIGN.md §7); torchrun adds RANK, LOCAL_RANK, WORLD_SIZE.
        ENV_DATA_DIR: DATA_MOUNT, ENV_CKPT_DIR: CKPT_MOUNT, ENV_LOG_DIR: LOG_MOUNT, **user_env(facts),
    }
    if attempt.resume:
        env[ENV_RESUME] = "1"
    if attempt.number:  # the trainer records it in metrics.jsonl (docs/DESIGN.md §7)
        env.update({ENV_RESTART: str(attempt.number), ENV_RESTART_CAUSE: attempt.cause})
    if not resources.cpu_mode:
        env["NCCL_SOCKET_IFNAME"] = iface
        # The image's TORCH_NCCL_ASYNC_ERROR_HANDLING=3 stays (tear down on a failed collective, with the flight
        # recorder dumped first; 1 would skip the dump). The dumps go to the node's log dir, not the container's
        # /tmp that goes away with it.
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{LOG_MOUNT}/{FR_DUMP_PREFIX}"
    gpus_here = gpu_set(resources, host, facts)
    held = gpus_here.ids if gpus_here.held else ()  # what the containers claim with their label
    env.update(_simulated_devices(resources, held))
    env.update(program.env_dict)  # the user's --env last: it may override the defaults on purpose
    ids = gpus_here.ids
    n_gpus = 0 if resources.cpu_mode else len(ids) if ids else resources.gpus if resources.gpus > 0 else host.slots or GPUS_ALL
    return ContainerSpec(
        rank=rank, host=host, name=container_name(program.job, rank, facts.login), image=program.image, command=tuple(command),
        env=env,
        mounts=(Mount(dirs["data"], DATA_MOUNT, read_only=True), Mount(dirs["ckpt"], CKPT_MOUNT),
                Mount(dirs["log"], LOG_MOUNT)),
        labels={JOB_LABEL: program.job, RANK_LABEL: str(rank), NNODES_LABEL: str(nnodes), VERSION_LABEL: __version__,
                RESTART_LABEL: str(attempt.number), RESTART_CAUSE_LABEL: attempt.cause,
                **owner_labels(facts.user, facts.login), **_claim_labels(rank, held, master_port)},
        gpus=n_gpus, gpu_ids=ids, ipc_mode=None if resources.shm_size else "host", shm_size=resources.shm_size,
        memory=resources.memory, dirs=dirs,
        ulimits=CPU_ULIMITS if resources.cpu_mode else GPU_ULIMITS, user=facts.user,
    )


def _claim_labels(rank: int, gpu_set: tuple[int, ...], port: int | None) -> dict[str, str]:
    """The GPU set every container holds, and node 0's master port: what the next job's preflight reads."""
    labels = {GPUS_LABEL: gpus.gpus_text(gpu_set)} if gpu_set else {}
    if rank == 0 and port is not None:
        labels[PORT_LABEL] = str(port)
    return labels


def _simulated_devices(resources: Resources, gpu_set: tuple[int, ...]) -> dict[str, str]:
    """Hosts whose GPUs are CPU stand-ins (gpus_on_cpu): what a container on a GPU node sees without a DeviceRequest
    to make it so. Docker's NVIDIA device driver sets NVIDIA_VISIBLE_DEVICES to the requested device IDs (moby daemon/nvidia_linux.go); CUDA in
    the container then numbers those GPUs 0..k-1. On a real GPU node neither is set here: Docker does it."""
    if not (resources.gpus_on_cpu and gpu_set):
        return {}
    return {"NVIDIA_VISIBLE_DEVICES": gpus.gpus_text(gpu_set),
            "CUDA_VISIBLE_DEVICES": gpus.gpus_text(range(len(gpu_set)))}


# ---- the JobPlan: one attempt, every node, everything it does -------------------------------------------


@dataclass(frozen=True)
class ImageAction:
    """What the node gets of the image: "present" (nothing), "send" (the layers it lacks) or "pull"."""

    kind: str
    layers: int = 0  # the image's layers ("send")
    layers_held: int = 0  # leading layers the node holds already: not sent
    bytes: int | None = None  # uncompressed size of the layers sent (None: not known); sent compressed
    pull_base: str = ""  # "send": the base the node pulls from its registry first; its layers are not sent
    base_layers: int = 0  # how many leading layers that base is
    base_why: str = ""  # "send": why the node lacks the base and gets its layers from here ("" : it holds it)

    @property
    def sent_from(self) -> int:
        """The first layer sent from here: the node holds the ones before, or pulls them with the base."""
        return max(self.layers_held, self.base_layers if self.pull_base else 0)

    @property
    def layers_sent(self) -> int:
        return self.layers - self.sent_from if self.kind == "send" else 0


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
class NodePlan:
    rank: int
    host: Host
    dirs: Mapping[str, str]  # data/ckpt/log folders on the host, ~ resolved
    verdicts: tuple[CheckResult, ...]  # preflight's (plan/verdicts.py), in the table's order
    gpus: gpuset.GpuSet  # the GPUs the node gets, and why
    image: ImageAction
    data: DataAction
    leftovers: tuple[str, ...]  # containers of the job there, removed before the start
    container: ContainerSpec
    # The short containers run there before the job's (plan/shortlived.py); None: not run.
    gpu_probe: ContainerSpec | None = None
    fetch: ContainerSpec | None = None
    network_check: ContainerSpec | None = None


@dataclass(frozen=True)
class JobPlan:
    """Everything one attempt of `up` does, per node; built once, then only read."""

    job: str
    attempt: Attempt
    master: str  # address:port of the rendezvous
    launcher: Launcher | None  # None: with --pull, read from the image once node 0 pulled it
    resume: ResumePoint | None
    nodes: tuple[NodePlan, ...]
    # The image check's container (plan/shortlived.py), run before the rest of the plan, whose launcher it answers;
    # `image_check_on` says where: "here", node 0's host, or "" (remembered from an earlier check, or not run yet:
    # with --pull, after node 0 pulled the image).
    image_check: ContainerSpec | None = None
    image_check_on: str = ""
    relay_mode: str = "off"  # --relay: whether the layers go to one node and from it to the others (plan/relay.py)

    @property
    def specs(self) -> list[ContainerSpec]:
        return [n.container for n in self.nodes]

    @property
    def head(self) -> tuple[str, ...]:
        """What starts the processes of every node (launch_head): the commands' head."""
        command = self.nodes[0].container.command
        return command[:len(command) - len(_after_launcher(self.nodes[0].container))]

    @property
    def torchrun(self) -> tuple[str, ...]:
        """The image's torchrun (`check`'s self-test runs several processes on a node whatever the job's count)."""
        return self.launcher.torchrun if self.launcher is not None else TORCHRUN

    def with_launcher(self, launcher: Launcher) -> JobPlan:
        """The plan whose launcher the image check found after a pull: only the command's head changes."""
        old = len(self.head)
        head = launch_head(launcher, [_nproc(n.container) for n in self.nodes])
        nodes = tuple(dataclasses.replace(n, container=dataclasses.replace(
            n.container, command=(*head, *n.container.command[old:]))) for n in self.nodes)
        return dataclasses.replace(self, launcher=launcher, nodes=nodes)


    def with_claim(self, specs: Sequence[ContainerSpec], port: int | None) -> JobPlan:
        """The plan as a lost GPU/port claim re-planned it (backends/docker_ssh/claim.py): other GPU sets or another port."""
        nodes = tuple(dataclasses.replace(n, container=spec) for n, spec in zip(self.nodes, specs, strict=True))
        return dataclasses.replace(self, master=f"{self.master.rsplit(':', 1)[0]}:{port}", nodes=nodes)


def _nproc(spec: ContainerSpec) -> int | str:
    count = spec.env["NPROC_PER_NODE"]
    return int(count) if count.isdigit() else count


def _after_launcher(spec: ContainerSpec) -> tuple[str, ...]:
    return spec.command[spec.command.index("--nnodes"):]


def image_action(delivery: Delivery, local: LocalImage | None, node: NodeFacts) -> ImageAction:
    """PURE: the same ID is there: nothing; else pulled (--pull) or its missing layers sent. Without a local
    image preflight passes only where the node holds it."""
    if delivery.pull:
        missing = node.image_id is None or (local is not None and node.image_id != local.id)
        return ImageAction("pull" if missing else "present")
    if local is None or node.image_id == local.id:
        return ImageAction("present")
    held = min(node.layers_held, local.layers)
    base = local.base
    if base is None or not lacks_base(base, held):
        return _send(local, held)
    if base.why or node.base_reach:
        return _send(local, held, base_why=base.why or node.base_reach)
    return _send(local, held, pull_base=base.ref, base_layers=base.layers)


def _send(local: LocalImage, held: int, **base: Any) -> ImageAction:
    action = ImageAction("send", local.layers, held, None, **base)
    size = sum(local.sizes[action.sent_from:]) if local.sizes is not None else None
    return dataclasses.replace(action, bytes=size)


def data_action(data: Data, is_trainer: bool, node: NodeFacts, archive_bytes: int | None, from_folder: bool) -> DataAction:
    """PURE: CIFAR-10 is the trainer's data (downloaded, or its archive sent, unless a verified copy is there);
    a folder of --data-from (or, for another program, a single file) is synced; else nothing."""
    if data.data_from is not None and (from_folder or not is_trainer):
        return DataAction("sync", str(data.data_from))
    if not is_trainer:
        return DataAction("none")
    if node.data_present:
        return DataAction("present")
    if data.data_from is not None:
        return DataAction("send", str(data.data_from), archive_bytes)
    return DataAction("download", url_masked(data.data_url))


def plan_job(inputs: PlanInputs) -> JobPlan:
    """PURE: the attempt's plan from its inputs; its short containers are added by plan/shortlived.py's
    `with_short_containers`."""
    specs = container_specs(inputs)
    program, resources, facts = inputs.program, inputs.resources, inputs.node_facts
    pipeline_layout(program.pipeline_stages, [nproc_for(resources, h, f) for h, f in zip(inputs.hosts, facts, strict=True)])
    judged = inputs.verdicts if inputs.verdicts is not None else tuple(() for _ in inputs.hosts)
    nodes = tuple(NodePlan(rank, spec.host, spec.dirs, judged[rank], gpu_set(resources, spec.host, f),
                           image_action(inputs.delivery, inputs.local, f),
                           data_action(inputs.data, program.is_trainer, f, inputs.archive_bytes, inputs.from_folder),
                           f.leftovers, spec)
                  for rank, (spec, f) in enumerate(zip(specs, facts, strict=True)))
    return JobPlan(program.job, inputs.attempt, f"{inputs.master_addr}:{inputs.port}", inputs.launcher, inputs.resume,
                   nodes, relay_mode=inputs.delivery.relay)
