"""The GPU probe at preflight: can a container of the job's image, with the job's device request, use the GPUs
the job will use on each node? A fact from the node instead of a guess from the host (nvidia-smi on PATH).

One short container per node runs trainer/gpuprobe.py (as `python3 -c`, through the image's entrypoint, where
NGC sets up CUDA forward compatibility) as the job's user, with the job's device request, devices, capabilities
and ulimits, and answers: torch's CUDA and the driver's, cuInit's own error, the device files the user cannot
open, the GPUs torch counts, NCCL's version, a tiny kernel. A failure is one line per host naming what is wrong:
no NVIDIA runtime registered with the daemon, a device file the job's user cannot open, CUDA's error with a hint
(802: the fabric manager), a CPU build of torch, a driver whose CUDA major version is below the image's, fewer
GPUs than asked, a kernel that fails. A probe that passed is remembered per (image ID, host, GPUs, the probe
container's arguments, the host's boot id and driver) in $XDG_CACHE_HOME/ddp-cifar/gpu-probes, like the image
check (orchestrate/probe/imagecheck.py): a reboot (the fabric manager may not be up) or a driver change probes
again, and so does every restart (it follows a failure, and a GPU fallen off the bus, XID 79, changes neither).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrate.backends.protocol import NodesT, Scheduler, ShortRunResult
from orchestrate.errors import PreflightError
from orchestrate.fanout import fan_out
from orchestrate.localfs import cache_root, write_atomically
from orchestrate.plan.jobplan import ContainerSpec
from trainer.contract import GPU_PROBE_FIELDS

PROBE_TIMEOUT_S = 180  # importing torch and starting CUDA on 8 GPUs takes seconds, never minutes
# Docker's answer when a device request names GPUs and no runtime hook for them is registered with dockerd
# (the NVIDIA Container Toolkit not installed or not configured): 'could not select device driver "" with
# capabilities: [[gpu]]' (docker/daemon/devices.go; quoted in NVIDIA/nvidia-docker#1034 and #1352).
NO_RUNTIME_TEXT = "could not select device driver"
BOOT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# cuInit's CUresult -> what to look at (cuda.h's comments on each code; CUDA driver API, "Error Handling").
CUDA_HINTS = {
    46: "a GPU is in exclusive-process compute mode and another process holds it (nvidia-smi -q -d COMPUTE)",
    100: "no GPU reached the container; check the device request (--gpus) and nvidia-smi on the host",
    802: "is nvidia-fabricmanager running? On NVSwitch systems (HGX) CUDA waits for it "
         "(systemctl status nvidia-fabricmanager; its version must match the driver's)",
    803: "the container's libcuda does not match the host's kernel module (a CUDA compat package built for "
         "another driver?); use the image's own compat setup, or an image built for this driver",
    804: "CUDA forward compatibility works only on data-center GPUs; upgrade the driver, or use an image built "
         "for the driver's CUDA",
    999: "look for NVIDIA XID errors in the host's kernel log (dmesg | grep -i xid; XID 79: a GPU fell off the "
         "bus and the node needs a reset); is the nvidia_uvm module loaded?",
}


@dataclass(frozen=True)
class ProbeFacts:
    """trainer/gpuprobe.py's answer (trainer.contract.GPU_PROBE_FIELDS)."""

    arch: str | None = None
    torch: str | None = None
    cuda: str | None = None
    driver_cuda: int | None = None
    driver: str | None = None
    count: int = 0
    nccl: str | None = None
    kernel: str | None = None
    warning: str | None = None
    cu_init: int | None = None
    cu_error: str | None = None
    denied: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeResult:
    label: str
    problem: str | None  # None: the node can run the job on its GPUs
    text: str  # what the table shows: the summary, or the problem


def script() -> str:
    spec = importlib.util.find_spec("trainer.gpuprobe")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text()


def parse(output: str) -> ProbeFacts | None:
    """PURE: the probe's JSON line (the last line that is one; NGC's entrypoint prints a banner first)."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            known = {k: data.get(k) for k in GPU_PROBE_FIELDS if k in data}
            known["count"] = int(known.get("count") or 0)
            known["denied"] = tuple(known.get("denied") or ())
            return ProbeFacts(**known)
    return None


def cuda_text(version: int) -> str:
    """cuDriverGetVersion's integer as CUDA writes it: 12080 -> '12.8'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def major(text: str) -> int:
    """'12.8' -> 12. CUDA's minor version compatibility runs a 12.x build on any 12.y driver (y < x included,
    short of PTX JIT), so only the major version can make a driver too old."""
    head = text.split(".")[0]
    return int(head) if head.isdigit() else 0


def launch_problem(explanation: str) -> str:
    """PURE: why the probe container could not start, said as what to do."""
    if NO_RUNTIME_TEXT in explanation:
        return ("no NVIDIA container runtime is registered with this host's Docker daemon (it answered "
                f"{' '.join(explanation.split())[:120]!r}); install the NVIDIA Container Toolkit, run "
                "'nvidia-ctk runtime configure --runtime=docker' and restart dockerd")
    return f"the GPU probe container could not start ({' '.join(explanation.split())[:200]})"


def judge(facts: ProbeFacts | None, need: int, user: str | None = None) -> str | None:
    """PURE: None when the container sees at least `need` working GPUs and the job's user (`user`, uid:gid) can
    open every GPU and RDMA device file it gets, else the one thing that is wrong."""
    if facts is None:
        return "the GPU probe printed no answer; does the image have python3?"
    if facts.denied:
        who = f"uid:gid {user}" if user else "the job's user"
        return (f"the job's user ({who}) cannot open {', '.join(facts.denied)}; give it access to these devices "
                "on the host (their group, or a udev rule), since the job runs as that user, not as root")
    if facts.torch is None:
        return f"the image's torch does not import ({facts.warning}); use an image with torch"
    if facts.cuda is None:
        return (f"the image's torch {facts.torch} is a CPU build (no CUDA); use a CUDA image (make image), "
                "or --gpus 0 to train on the CPU")
    if facts.count >= need and facts.kernel == "ok":
        return None
    if facts.driver_cuda is None and facts.cu_init is None:
        return ("no CUDA in the container: no GPU driver was passed in (libcuda.so.1 missing); check the "
                "NVIDIA Container Toolkit on this host")
    if facts.cu_init:
        hint = CUDA_HINTS.get(facts.cu_init, "see the driver's log on the host (dmesg)")
        return f"CUDA does not start: error {facts.cu_init} {facts.cu_error}; {hint}"
    return _count_or_kernel(facts, need)


def _count_or_kernel(facts: ProbeFacts, need: int) -> str:
    """CUDA started: a driver too old for the image's CUDA, too few GPUs, or a kernel that failed."""
    assert facts.cuda is not None
    if facts.count == 0 and facts.driver_cuda is not None and major(cuda_text(facts.driver_cuda)) < major(facts.cuda):
        release = f"driver {facts.driver}" if facts.driver else "the driver"
        return (f"{release} supports CUDA up to {cuda_text(facts.driver_cuda)}, the image's torch needs CUDA "
                f"{facts.cuda} and forward compatibility is not available here; upgrade the driver, or use an "
                f"image built for CUDA {cuda_text(facts.driver_cuda)}")
    if facts.count < need:
        why = f" ({facts.warning})" if facts.warning else ""
        return f"{facts.count} GPU(s) usable in the container, {need} needed{why}; lower --gpus or slots="
    return f"a test kernel failed on the GPUs: {facts.kernel}"


def summary(facts: ProbeFacts) -> str:
    """PURE: what passed, for the table and a bug report."""
    driver = f"driver {facts.driver or '?'}"
    if facts.driver_cuda is not None:
        driver += f" (CUDA {cuda_text(facts.driver_cuda)})"
    return f"{facts.count} GPU(s), torch {facts.torch} CUDA {facts.cuda}, {driver}, NCCL {facts.nccl or '?'}"


def need_of(spec: ContainerSpec) -> int:
    """GPUs the node's processes use: one per process (local rank = GPU index)."""
    nproc = spec.env.get("NPROC_PER_NODE", "")
    return int(nproc) if nproc.isdigit() else 1


def probe_all(scheduler: Scheduler[NodesT], nodes: NodesT, specs: Sequence[ContainerSpec], probes: Sequence[ContainerSpec | None],
              image_id: str | None) -> list[ProbeResult]:
    """Probe every node in parallel with the plan's probe containers (`probes`, beside the job's `specs`), run by
    the scheduler; a pass remembered for this image, boot and driver is not probed again; with no image ID every
    node is probed."""

    def one(r: int) -> ProbeResult:
        state = read_node_state(lambda: scheduler.boot_and_driver(nodes, r)) if image_id else None
        probe = probes[r]
        assert probe is not None  # planned for every node of a GPU job (plan/shortlived.py)
        return probe_node(lambda p: scheduler.run(nodes, {r: p}, PROBE_TIMEOUT_S, "GPU probe")[r], specs[r], probe,
                          image_id, state)
    return fan_out("GPU probe", list(range(len(specs))), one, lambda r: specs[r].host.label)


def node_state(out: str) -> str | None:
    """PURE: the host's boot id and driver version text (Scheduler.boot_and_driver's answer); None when no boot id is
    there (then nothing is remembered: the probe runs every time)."""
    lines = out.strip().splitlines()
    return out.strip() if lines and BOOT_ID.match(lines[0].strip()) else None


def read_node_state(read: Callable[[], str]) -> str | None:
    """The host's state as `read` (the scheduler) tells it, read before the memory is consulted."""
    try:
        return node_state(read())
    except Exception:  # SSH trouble: probe without the memory; preflight names an unreachable host
        return None


def require(results: Sequence[ProbeResult]) -> None:
    """Nothing starts unless every node passed: one line per failing host."""
    failed = [r for r in results if r.problem]
    if failed:
        raise PreflightError("GPU probe failed, nothing was started:\n  "
                             + "\n  ".join(f"{r.label}: {r.problem}" for r in failed))


def probe_node(run: Callable[[ContainerSpec], ShortRunResult], spec: ContainerSpec, probe: ContainerSpec,
               image_id: str | None, state: str | None) -> ProbeResult:
    """`spec`: the job's container, `probe`: its probe's, run by `run`; `state`: the host's boot and driver
    (node_state); the memory is used only with an image ID and a state."""
    need = need_of(spec)
    memo = _memo_path(image_id, state, spec.host.label, need, probe) if image_id and state else None
    remembered = _recall(memo) if memo else None
    if remembered is not None and judge(remembered, need, spec.user) is None:
        return ProbeResult(spec.host.label, None, summary(remembered))
    ran = run(probe)
    facts = parse(ran.stdout) if ran.exit_code is not None else None
    problem = launch_problem(ran.error) if ran.exit_code is None else judge(facts, need, spec.user)
    if problem is not None:
        return ProbeResult(spec.host.label, problem, problem)
    assert facts is not None  # judge() names a missing answer as a problem
    if memo is not None:
        with contextlib.suppress(OSError):  # an unwritable cache costs a probe next time, no more
            write_atomically(memo, [json.dumps(dataclasses.asdict(facts)).encode()])
    return ProbeResult(spec.host.label, None, summary(facts))


def _memo_path(image_id: str, state: str, label: str, need: int, probe: ContainerSpec) -> Path:
    """Keyed by everything that decides the answer: the image, the host and its boot and driver, the GPUs needed and
    the container's arguments (the script's text included), but not its labels (the job's name)."""
    args = json.dumps({k: v for k, v in dataclasses.asdict(probe).items() if k not in ("labels", "host")},
                      sort_keys=True, default=str)
    key = hashlib.sha256("\0".join((image_id, state, label, str(need), args)).encode()).hexdigest()[:32]
    return cache_root() / "gpu-probes" / f"{key}.json"


def _recall(path: Path) -> ProbeFacts | None:
    """A remembered pass; None when there is none or it is damaged (then the probe runs again)."""
    try:
        return parse(path.read_text())
    except OSError:
        return None
