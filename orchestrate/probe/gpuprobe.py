"""The GPU probe at preflight: can a container of the job's image, with the job's device request, use the GPUs
the job will use on each node? A fact from the node instead of a guess from the host (nvidia-smi on PATH).

One short container per node runs trainer/gpuprobe.py (as `python3 -c`, through the image's entrypoint, where
NGC sets up CUDA forward compatibility) and answers: torch's CUDA and the driver's, the GPUs torch counts,
NCCL's version, a tiny kernel. A failure is one line per host naming what is wrong: no NVIDIA runtime
registered with the daemon, a CPU build of torch, a driver too old for the image's CUDA, fewer GPUs than
asked, a kernel that fails. A probe that passed is remembered per (image ID, host, GPUs, device request) in
$XDG_CACHE_HOME/ddp-cifar/gpu-probes, like the image check (orchestrate/probe/imagecheck.py): an image ID names its
content, and a host's GPUs and driver rarely change between two runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import PreflightError
from orchestrate.jobs.memory import cache_root, write_atomically
from orchestrate.jobs.owner import OWNER_LABEL, OWNER_UID_LABEL
from orchestrate.plan.jobplan import NodeSpec
from orchestrate.remote.docker import JOB_LABEL
from orchestrate.remote.session import Nodes
from orchestrate.remote.ssh import fan_out
from trainer.contract import GPU_PROBE_FIELDS

PROBE_TIMEOUT_S = 180  # importing torch and starting CUDA on 8 GPUs takes seconds, never minutes
# Docker's answer when a device request names GPUs and no runtime hook for them is registered with dockerd
# (the NVIDIA Container Toolkit not installed or not configured): 'could not select device driver "" with
# capabilities: [[gpu]]' (docker/daemon/devices.go; quoted in NVIDIA/nvidia-docker#1034 and #1352).
NO_RUNTIME_TEXT = "could not select device driver"


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
            return ProbeFacts(**known)
    return None


def cuda_text(version: int) -> str:
    """cuDriverGetVersion's integer as CUDA writes it: 12080 -> '12.8'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _as_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def launch_problem(explanation: str) -> str:
    """PURE: why the probe container could not start, said as what to do."""
    if NO_RUNTIME_TEXT in explanation:
        return ("no NVIDIA container runtime is registered with this host's Docker daemon (it answered "
                f"{' '.join(explanation.split())[:120]!r}); install the NVIDIA Container Toolkit, run "
                "'nvidia-ctk runtime configure --runtime=docker' and restart dockerd")
    return f"the GPU probe container could not start ({' '.join(explanation.split())[:200]})"


def judge(facts: ProbeFacts | None, need: int) -> str | None:
    """PURE: None when the container sees at least `need` working GPUs, else the one thing that is wrong."""
    if facts is None:
        return "the GPU probe printed no answer; does the image have python3?"
    if facts.torch is None:
        return f"the image's torch does not import ({facts.warning}); use an image with torch"
    if facts.cuda is None:
        return (f"the image's torch {facts.torch} is a CPU build (no CUDA); use a CUDA image (make image), "
                "or --gpus 0 to train on the CPU")
    if facts.count >= need and facts.kernel == "ok":
        return None
    if facts.count == 0 and facts.driver_cuda is None:
        return ("no CUDA in the container: no GPU driver was passed in (libcuda.so.1 missing); check the "
                "NVIDIA Container Toolkit on this host")
    if facts.count == 0 and facts.driver_cuda is not None and \
            _as_tuple(cuda_text(facts.driver_cuda)) < _as_tuple(facts.cuda):
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


def need_of(spec: NodeSpec) -> int:
    """GPUs the node's processes use: one per process (local rank = GPU index)."""
    nproc = spec.env.get("NPROC_PER_NODE", "")
    return int(nproc) if nproc.isdigit() else 1


def probe_all(nodes: Nodes, specs: Sequence[NodeSpec], image_id: str | None) -> list[ProbeResult]:
    """Probe every node in parallel (a remembered pass is not probed again)."""
    return fan_out("GPU probe", list(range(len(specs))),
                   lambda r: probe_node(nodes.docker(r, timeout=PROBE_TIMEOUT_S), specs[r], image_id),
                   lambda r: specs[r].host.label)


def require(results: Sequence[ProbeResult]) -> None:
    """Nothing starts unless every node passed: one line per failing host."""
    failed = [r for r in results if r.problem]
    if failed:
        raise PreflightError("GPU probe failed, nothing was started:\n  "
                             + "\n  ".join(f"{r.label}: {r.problem}" for r in failed))


def probe_node(client: Any, spec: NodeSpec, image_id: str | None) -> ProbeResult:
    need = need_of(spec)
    memo = _memo_path(image_id, spec, need) if image_id else None
    remembered = _recall(memo) if memo else None
    if remembered is not None and judge(remembered, need) is None:
        return ProbeResult(spec.host.label, None, summary(remembered))
    facts, cannot_start = _run(client, spec)
    problem = cannot_start or judge(facts, need)
    if problem is not None:
        return ProbeResult(spec.host.label, problem, problem)
    assert facts is not None  # judge() names a missing answer as a problem
    if memo is not None:
        with contextlib.suppress(OSError):  # an unwritable cache costs a probe next time, no more
            write_atomically(memo, [json.dumps(dataclasses.asdict(facts)).encode()])
    return ProbeResult(spec.host.label, None, summary(facts))


def probe_labels(spec: NodeSpec) -> dict[str, str]:
    """PURE: the probe container's labels: its own job name, and the job's owner (so `status --all` shows whose it
    is, and only its owner's kill removes it)."""
    owners = {k: v for k, v in spec.labels.items() if k in (OWNER_LABEL, OWNER_UID_LABEL)}
    return {**owners, JOB_LABEL: f"{spec.labels[JOB_LABEL]}-gpuprobe"}


def _run(client: Any, spec: NodeSpec) -> tuple[ProbeFacts | None, str | None]:
    """(facts, None), or (None, why the container could not start). Created, started and removed here: a
    container whose start failed would otherwise stay behind."""
    import docker.errors

    kwargs = spec.sdk_kwargs()
    try:
        container = client.containers.create(
            spec.image, command=["python3", "-c", script()], device_requests=kwargs["device_requests"],
            init=True, network_mode="none", labels=probe_labels(spec))
    except docker.errors.APIError as err:
        return None, launch_problem(str(err.explanation or err))
    try:
        container.start()
        container.wait(timeout=PROBE_TIMEOUT_S)
        return parse(container.logs(stdout=True, stderr=False).decode(errors="replace")), None
    except docker.errors.APIError as err:
        return None, launch_problem(str(err.explanation or err))
    finally:
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)


def _memo_path(image_id: str, spec: NodeSpec, need: int) -> Path:
    request = json.dumps(spec.sdk_kwargs()["device_requests"], sort_keys=True, default=str)
    key = hashlib.sha256("\0".join((image_id, spec.host.label, str(need), request)).encode()).hexdigest()[:32]
    return cache_root() / "gpu-probes" / f"{key}.json"


def _recall(path: Path) -> ProbeFacts | None:
    """A remembered pass; None when there is none or it is damaged (then the probe runs again)."""
    try:
        return parse(path.read_text())
    except OSError:
        return None
