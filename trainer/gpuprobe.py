"""GPU probe: what a container of this image sees of the node's GPUs. Printed as one JSON line, never raising.

The orchestrator runs this file's text as `python3 -c` in one short container of the job's image, as the job's
user, with the job's device request, devices, capabilities and ulimits, through the image's entrypoint (on NGC
images that is where CUDA forward compatibility is set up), so the answer is what the job itself would see. It needs only Python and torch, so
any image the job may name can run it; the fields are trainer.contract.GPU_PROBE_FIELDS (this file cannot
import the contract: it runs outside the project's image too). The orchestrator judges the answer
(orchestrate/probe/gpuprobe.py).
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import platform
import re
import warnings
from typing import Any

# The device files the job opens: the GPUs' (nvidiactl, nvidia-uvm, one per GPU) and, when the job gets
# /dev/infiniband, the verbs devices and the RDMA connection manager that NCCL's IB transport opens. Not umad*
# or issm* (subnet management, root-only by design) nor nvidia-caps (MIG administration).
DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia[0-9]*", "/dev/infiniband/uverbs*",
                "/dev/infiniband/rdma_cm")


def libcuda() -> Any | None:
    """The driver's libcuda.so.1; None when it cannot be loaded (no GPU driver passed in)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def driver_cuda(lib: Any) -> int | None:
    """The highest CUDA version the loaded driver supports (cuDriverGetVersion, e.g. 12080 for 12.8). With
    NGC's forward compatibility active this is the compat library's version."""
    version = ctypes.c_int(0)
    return int(version.value) if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def cuda_init(lib: Any) -> tuple[int, str | None]:
    """cuInit(0)'s CUresult and, when it failed, CUDA's own words for it ("CUDA_ERROR_SYSTEM_NOT_READY: system
    not yet initialized"). torch says only that it found no GPU; this is the cause."""
    code = int(lib.cuInit(0))
    if code == 0:
        return 0, None
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return code, f"{(name.value or b'?').decode()}: {(text.value or b'?').decode()}"


def unopenable(patterns: tuple[str, ...] = DEVICE_FILES) -> list[str]:
    """The device files present here that this process (the job's uid and groups) cannot open for reading and
    writing, as 'path: reason'. Root opens any of them; the job's user may not."""
    denied = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        try:
            os.close(os.open(path, os.O_RDWR))
        except OSError as err:
            denied.append(f"{path}: {err.strerror}")
    return denied


def driver_release() -> str | None:
    """The kernel module's release (e.g. 550.54.15), as NGC's entrypoint reads it."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            match = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", fh.read())
    except OSError:
        return None
    return match.group(1) if match else None


def tiny_kernel(torch: Any, count: int) -> str:
    """'ok' when a small computation on every visible GPU gives the right answer, else what went wrong."""
    try:
        for index in range(count):
            got = float((torch.ones(1024, device=f"cuda:{index}") * 2).sum().item())
            if got != 2048.0:
                return f"cuda:{index} computed {got}, expected 2048"
    except Exception as err:  # the probe reports, never raises: the orchestrator names the host
        return f"{type(err).__name__}: {err}"
    return "ok"


def probe() -> dict[str, Any]:
    lib = libcuda()
    out: dict[str, Any] = {"arch": platform.machine(), "torch": None, "cuda": None, "driver_cuda": None,
                           "driver": driver_release(), "count": 0, "nccl": None, "kernel": None, "warning": None,
                           "cu_init": None, "cu_error": None, "denied": unopenable()}
    if lib is not None:
        out["driver_cuda"] = driver_cuda(lib)
        out["cu_init"], out["cu_error"] = cuda_init(lib)
    try:
        import torch
    except Exception as err:
        out["warning"] = f"import torch: {type(err).__name__}: {err}"
        return out
    out["torch"], out["cuda"] = torch.__version__, torch.version.cuda
    # torch does not raise when CUDA cannot start: it warns ("CUDA initialization: The NVIDIA driver on your
    # system is too old (found version 12080) ...") and counts 0 devices. The warning is the reason to show.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["count"] = int(torch.cuda.device_count()) if out["cuda"] else 0
    if caught:
        out["warning"] = " ".join(str(caught[0].message).split())[:300]
    if out["count"]:
        out["kernel"] = tiny_kernel(torch, out["count"])
        try:
            out["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception as err:
            out["nccl"] = f"unknown ({type(err).__name__})"
    return out


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


def why_no_cuda(facts: dict[str, Any]) -> str:
    """PURE: why torch sees no GPU on this machine, in one line, from probe()'s answer: for a bare GPU machine
    (the GPU tier, scripts/gpu-check.sh), where "no CUDA here" would hide the usual cause of a fresh machine: a
    torch built for a newer CUDA major than the driver supports (CUDA's minor version compatibility covers the
    minor versions, never the major)."""
    torch_text = f"torch {facts.get('torch')}"
    if facts.get("torch") is None:
        return f"python3 has no torch ({facts.get('warning')}): install a CUDA build of torch"
    if facts.get("cuda") is None:
        return f"{torch_text} is a CPU build (no CUDA): this needs an NVIDIA GPU and a CUDA build of torch"
    if facts.get("driver_cuda") is None and facts.get("cu_init") is None:
        return (f"no NVIDIA driver here (libcuda.so.1 not found; {torch_text} is built for CUDA {facts['cuda']}): "
                "this needs a machine with an NVIDIA GPU and its driver")
    if facts.get("cu_init"):
        return f"CUDA does not start: error {facts['cu_init']} {facts.get('cu_error')} (see dmesg on this machine)"
    driver_cuda = int(facts.get("driver_cuda") or 0)
    driver = f"driver {facts.get('driver') or '?'}"
    if driver_cuda and driver_cuda // 1000 < _major(str(facts["cuda"])):
        supported = f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"
        return (f"the {driver} supports CUDA up to {supported}, {torch_text} is built for CUDA {facts['cuda']}: "
                f"install a torch built for CUDA {driver_cuda // 1000}.x (e.g. pip install torch --index-url "
                f"https://download.pytorch.org/whl/cu{driver_cuda // 1000}{driver_cuda % 1000 // 10}), or a "
                "newer driver")
    warning = f" ({facts['warning']})" if facts.get("warning") else ""
    return f"{torch_text} (CUDA {facts['cuda']}, {driver}) counts no usable GPU{warning}"


if __name__ == "__main__":
    print(json.dumps(probe()), flush=True)
