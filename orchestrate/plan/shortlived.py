"""PURE: the attempt's short containers, decided with its plan like the job's own: the image check (run before
the rest of the plan, whose launcher it answers), and per node the GPU probe, the data fetch, the network check,
and `check`'s self-test. Each is a ContainerSpec that the scheduler materializes as it does the job's, and that
`--dry-run=hosts --json` prints. The programs they run come in as text (Scripts): reading them is not the plan's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.config import Checks, Data, Program, Resources
from orchestrate.hosts import Host
from orchestrate.labels import (
    DATA_MARKER,
    IMAGE_CHECK_LABEL,
    JOB_LABEL,
    OWNER_LABEL,
    OWNER_UID_LABEL,
    PREFETCH_LABEL,
    container_name,
)
from orchestrate.plan.jobplan import DATA_MOUNT, ContainerSpec, JobPlan, Mount
from trainer.contract import ARCHIVE_NAME, BASE_FOLDER, ENV_LOG_DIR


@dataclass(frozen=True)
class Scripts:
    """The text of each short container's program, sent as `python3 -c TEXT` (or `sh -c TEXT`)."""

    gpu_probe: str  # trainer/gpuprobe.py
    network_check: str  # trainer/bandwidth.py
    fetch: str  # remote/scripts/fetch.py
    find_python: str  # remote/scripts/find_python.sh
    check_image: str  # remote/scripts/check_image.py


def with_short_containers(plan: JobPlan, program: Program, resources: Resources, data: Data, checks: Checks,
                          scripts: Scripts, image_check_spec: ContainerSpec, image_check_on: str) -> JobPlan:
    """The attempt's plan with every short container it runs: the image check as it ran (`image_check_on`: where,
    "" when remembered), then per node the GPU probe (GPU jobs), the data fetch (where the data is downloaded or
    its archive sent) and, with --check-network on the first attempt, the network check."""
    network: Sequence[ContainerSpec | None] = [None] * len(plan.nodes)
    if checks.check_network and not plan.attempt.number:
        network = network_check(plan.specs, resources.cpu_mode, checks.check_max_mb, scripts.network_check)
    nodes = tuple(dataclasses.replace(
        n, gpu_probe=None if resources.cpu_mode else gpu_probe(n.container, scripts.gpu_probe),
        fetch=fetch(n.container, program, data, scripts.fetch) if n.data.kind in ("download", "send") else None,
        network_check=check) for n, check in zip(plan.nodes, network, strict=True))
    return dataclasses.replace(plan, nodes=nodes, image_check=image_check_spec, image_check_on=image_check_on)


def image_check(program: Program, host: Host, scripts: Scripts) -> ContainerSpec:
    """Can the image run the entry under torchrun? sh finds a Python (python or python3), then check_image.py
    answers in one JSON line. No network; the image's own user; run here or on node 0 (`host`)."""
    kind, target = program.entry_target
    return ContainerSpec(rank=0, host=host, name="", image=program.image, command=(kind, target), env={}, mounts=(),
                         labels={IMAGE_CHECK_LABEL: program.job}, gpus=0, ipc_mode=None, shm_size=None, init=False,
                         network_mode="none", entrypoint=("sh", "-c", scripts.find_python, "check", scripts.check_image))


# ---- the GPU probe ---------------------------------------------------------------------------------------

# The job's environment that decides what CUDA sees and where it may write; the rest (ports, secrets) is not the
# probe's business and would change the probe memory's key (checks/gpuprobe.py) on every job.
PROBE_ENV_NAMES = ("HOME", "USER", "LOGNAME")
PROBE_ENV_PREFIXES = ("CUDA_", "NVIDIA_")


def probe_labels(spec: ContainerSpec) -> dict[str, str]:
    """The probe container's labels: its own job name, and the job's owner (so `status --all` shows whose it is,
    and only its owner's kill removes it)."""
    return {**_owners(spec), JOB_LABEL: f"{spec.labels[JOB_LABEL]}-gpuprobe"}


def gpu_probe(spec: ContainerSpec, script: str) -> ContainerSpec:
    """The job's container turned into its GPU probe: the job's image, user, GPUs, devices (the InfiniBand folder
    when the job gets it), capabilities and ulimits, and the environment that decides what CUDA sees, so that a
    device file the job's uid cannot open fails the probe, not the job. No network (it needs none), no mounts."""
    env = {k: v for k, v in spec.env.items() if k in PROBE_ENV_NAMES or k.startswith(PROBE_ENV_PREFIXES)}
    return dataclasses.replace(spec, name="", command=("python3", "-c", script), env=env, mounts=(),
                               labels=probe_labels(spec), network_mode="none", ipc_mode=None, shm_size=None,
                               memory=None, extra_hosts=(), dirs={})


# ---- the data fetch --------------------------------------------------------------------------------------

def fetch(spec: ContainerSpec, program: Program, data: Data, script: str) -> ContainerSpec:
    """The node's data fetch: fetch.py in a short container of the job's image on the host network, downloading
    `--data-url` (or checking the archive sent, `-`) into the data folder, verifying its md5 and unpacking it; as
    the job's user, so that the files are theirs (HOME: the image's is root's)."""
    url = "-" if data.data_from is not None else data.data_url
    return ContainerSpec(
        rank=spec.rank, host=spec.host, name="", image=program.image,
        command=("python", "-c", script, data.data_md5, DATA_MOUNT, ARCHIVE_NAME, BASE_FOLDER,
                 DATA_MARKER),
        env={"HOME": "/tmp", "DATA_URL": url}, mounts=(Mount(spec.dirs["data"], DATA_MOUNT),),
        labels={PREFETCH_LABEL: program.job, **_owners(spec)}, gpus=0, ipc_mode=None, shm_size=None, init=False,
        dirs={"data": spec.dirs["data"]}, user=spec.user)


# ---- the network check -----------------------------------------------------------------------------------

PAIRS_UP_TO = 8  # every pair of up to this many nodes (28 pairs); above, the all-node figure only
JOIN_TIMEOUT_S = 30.0  # a node that cannot reach the master says so after this long
MIN_CPU_PROCESSES = 2  # a CPU node's check runs at least 2 processes, so that something is measured within it


def processes(spec: ContainerSpec, cpu: bool) -> int:
    """The node's process count in the job (one per GPU granted, slots= on CPU), at least MIN_CPU_PROCESSES on a
    CPU node."""
    count = spec.env.get("NPROC_PER_NODE", "1")
    n = int(count) if count.isdigit() else 1
    return max(n, MIN_CPU_PROCESSES) if cpu else n


def network_check(specs: Sequence[ContainerSpec], cpu: bool, max_mb: int, script: str) -> list[ContainerSpec]:
    """The job's containers turned into the network check's: same image, host network, interface settings, master
    and GPUs; the job's processes of each node (forked by the program), no mounts, the check's own name and job
    label (`kill --job JOB-netcheck`)."""
    job = f"{specs[0].labels[JOB_LABEL]}-netcheck"
    procs = ",".join(str(processes(s, cpu)) for s in specs)
    command = ("python3", "-c", script, "--procs", procs, "--device", "cpu" if cpu else "cuda",
               "--max-mb", str(max_mb), "--timeout", str(JOIN_TIMEOUT_S),
               *(("--pairs",) if len(specs) <= PAIRS_UP_TO else ()))
    return [dataclasses.replace(s, name=container_name(job, s.rank, s.labels.get(OWNER_LABEL)), command=command,
                                mounts=(), labels={**s.labels, JOB_LABEL: job}) for s in specs]


# ---- `check`'s self-test ---------------------------------------------------------------------------------

# The self-test's container has no network (loopback only): its rendezvous and its process group live there.
# Nor mounts: the trainer's log dir (rank 0's NCCL log) is the container's /tmp.
LOOPBACK = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NNODES": "1", "NODE_RANK": "0",
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", ENV_LOG_DIR: "/tmp"}


def selftest(specs: Sequence[ContainerSpec], program: Program, resources: Resources,
             torchrun: tuple[str, ...]) -> list[ContainerSpec]:
    """The job's containers turned into the self-test's: same image, environment, user and GPUs, the image's
    torchrun with the job's process count, on this node alone over loopback (static rendezvous on 127.0.0.1: torchrun's
    --standalone looks the container's name up, which a container without network cannot resolve); no mounts
    (it writes its checkpoint under the container's /tmp), its own name and job label."""
    job = f"{program.job}-selftest"
    device = "cpu" if resources.cpu_mode else "cuda"  # a GPU job must fail here when CUDA is missing, not fall back
    return [dataclasses.replace(
        s, name=container_name(job, s.rank, s.labels.get(OWNER_LABEL)), mounts=(), env={**s.env, **LOOPBACK},
        command=(*torchrun, "--nnodes", "1", "--master_addr", LOOPBACK["MASTER_ADDR"], "--master_port",
                 LOOPBACK["MASTER_PORT"], "--nproc_per_node", str(processes(s, resources.cpu_mode)),
                 "-m", "trainer.selftest", *program.trainer_args, "--device", device),
        network_mode="none", extra_hosts=(), labels={**s.labels, JOB_LABEL: job}) for s in specs]


def _owners(spec: ContainerSpec) -> dict[str, str]:
    return {k: v for k, v in spec.labels.items() if k in (OWNER_LABEL, OWNER_UID_LABEL)}
