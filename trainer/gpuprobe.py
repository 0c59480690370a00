"""GPU probe: what a container of this image sees of the node's GPUs. Printed as one JSON line, never raising.

The orchestrator runs this file's text as `python3 -c` in one short container of the job's image, with the
job's device request and through the image's entrypoint (on NGC images that is where CUDA forward
compatibility is set up), so the answer is what the job itself would see. It needs only Python and torch, so
any image the job may name can run it; the fields are trainer.contract.GPU_PROBE_FIELDS (this file cannot
import the contract: it runs outside the project's image too). The orchestrator judges the answer
(orchestrate/probe/gpuprobe.py).
"""

from __future__ import annotations

import ctypes
import json
import platform
import re
import warnings
from typing import Any


def driver_cuda() -> int | None:
    """The highest CUDA version the loaded driver supports (cuDriverGetVersion, e.g. 12080 for 12.8); None
    when no libcuda.so.1 can be loaded (no GPU passed in). With NGC's forward compatibility active this is
    the compat library's version."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    return int(version.value) if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


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
    out: dict[str, Any] = {"arch": platform.machine(), "torch": None, "cuda": None, "driver_cuda": driver_cuda(),
                           "driver": driver_release(), "count": 0, "nccl": None, "kernel": None, "warning": None}
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


if __name__ == "__main__":
    print(json.dumps(probe()), flush=True)
