"""The GPU probe's decisions, on the texts real nodes give, and its memory per image ID and host. The texts:
Docker's 'could not select device driver "" with capabilities: [[gpu]]' (NVIDIA/nvidia-docker#1034, #1352),
torch's 'CUDA initialization: The NVIDIA driver on your system is too old (found version 12080) ...'
(pytorch/pytorch#162531), NGC's entrypoint banner before the answer, cuInit's error 802 on an HGX node whose
fabric manager is down (CUDA_ERROR_SYSTEM_NOT_READY, "system not yet initialized", with torch's warning for it).
The hosts here have no GPU: a fake Docker client stands for a node in the memory tests, and a stand-in for
libcuda answers the probe's driver calls."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from kit.units import SSH, job_specs

from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.backends.docker_ssh.shortrun import run_one
from orchestrate.checks import gpuprobe
from orchestrate.checks.gpuprobe import ProbeFacts, ProbeResult, judge, launch_problem, parse
from orchestrate.config import UpConfig
from orchestrate.errors import PreflightError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.plan.shortlived import gpu_probe
from orchestrate.probe.observations import NodeFacts
from trainer import gpuprobe as probe_script
from trainer.contract import GPU_PROBE_FIELDS

HOST = Host(name="gpu1", hostname="10.0.0.1", port=22, user="u", slots=None)
GOOD = ProbeFacts(arch="x86_64", torch="2.9.0a0+nv25.10", cuda="13.0", driver_cuda=13000, driver="580.82.07",
                  count=8, nccl="2.27.7", kernel="ok")
TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12080). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org/ to install a "
           "PyTorch version that has been compiled with your version of the CUDA driver.")
DOCKER_NO_RUNTIME = 'could not select device driver "" with capabilities: [[gpu]]'
# An 8-GPU HGX H100 node just rebooted, nvidia-fabricmanager not started: the probe's line as the container prints it.
FM_DOWN = ('{"arch": "x86_64", "torch": "2.9.0a0+nv25.10", "cuda": "13.0", "driver_cuda": 13000, '
           '"driver": "580.82.07", "count": 0, "nccl": null, "kernel": null, "warning": "CUDA initialization: '
           'Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before calling '
           'NumCudaDevices() that might have already set an error? Error 802: system not yet initialized", '
           '"cu_init": 802, "cu_error": "CUDA_ERROR_SYSTEM_NOT_READY: system not yet initialized", "denied": []}')
BOOT = "5f1c6a0e-3d4b-4c9e-9a51-2b7f0e8d1c33\n"
DRIVER_580 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07  Wed Aug 27 16:59:31 UTC 2025\n"
NGC_BANNER = ("\n=============\n== PyTorch ==\n=============\n\nNVIDIA Release 25.10 (build 1)\n\n"
              "WARNING: The NVIDIA Driver was not detected.  GPU functionality will not be available.\n")


def test_the_answer_is_found_after_ngcs_banner() -> None:
    line = json.dumps({k: getattr(GOOD, k) for k in GPU_PROBE_FIELDS})
    assert parse(NGC_BANNER + line + "\n") == GOOD
    assert parse(NGC_BANNER) is None


def test_a_working_node_passes_and_is_summarised() -> None:
    assert judge(GOOD, 8) is None
    assert gpuprobe.summary(GOOD) == ("8 GPU(s), torch 2.9.0a0+nv25.10 CUDA 13.0, driver 580.82.07 (CUDA 13.0), "
                                      "NCCL 2.27.7")


def test_no_runtime_registered_with_the_daemon_says_how_to_install_it() -> None:
    line = launch_problem(f"Error response from daemon: {DOCKER_NO_RUNTIME}")
    assert line.startswith("no NVIDIA container runtime is registered with this host's Docker daemon")
    assert "nvidia-ctk runtime configure --runtime=docker" in line and "\n" not in line
    assert launch_problem("No such image: x:1").startswith("the GPU probe container could not start")


def test_a_driver_too_old_for_the_images_cuda_names_both_versions() -> None:
    facts = ProbeFacts(torch="2.9.0", cuda="13.0", driver_cuda=12080, driver="570.124.06", count=0, warning=TOO_OLD)
    assert judge(facts, 8) == ("driver 570.124.06 supports CUDA up to 12.8, the image's torch needs CUDA 13.0 and "
                               "forward compatibility is not available here; upgrade the driver, or use an image "
                               "built for CUDA 12.8")


def test_cuda_is_compared_by_major_version_only() -> None:
    """A 12.4 build runs on a 12.2 driver (minor version compatibility): a count of 0 there is another cause."""
    facts = ProbeFacts(torch="2.5.0", cuda="12.4", driver_cuda=12020, driver="535.104", count=0, cu_init=0,
                       warning="boom")
    assert judge(facts, 1) == "0 GPU(s) usable in the container, 1 needed (boom); lower --gpus or slots="


def test_cudas_own_error_is_reported_with_a_hint_802_names_the_fabric_manager() -> None:
    facts = parse(NGC_BANNER + FM_DOWN)
    line = str(judge(facts, 8))
    assert line.startswith("CUDA does not start: error 802 CUDA_ERROR_SYSTEM_NOT_READY: system not yet "
                           "initialized; is nvidia-fabricmanager running?"), line
    unknown = ProbeFacts(torch="2.9", cuda="13.0", driver_cuda=13000, cu_init=999, cu_error="CUDA_ERROR_UNKNOWN: unknown error")
    assert "XID 79" in str(judge(unknown, 1))


class FakeLibcuda:
    """libcuda.so.1 as the probe calls it: cuInit's CUresult, and the name and text of an error written through
    the pointer the caller passes (ctypes.byref(c_char_p), whose target is `_obj`)."""

    def __init__(self, code: int, name: bytes, text: bytes) -> None:
        self.code, self.name, self.text = code, name, text

    def cuInit(self, flags: int) -> int:  # noqa: N802 (the C name)
        return self.code

    def cuGetErrorName(self, code: int, out: Any) -> int:  # noqa: N802
        out._obj.value = self.name
        return 0

    def cuGetErrorString(self, code: int, out: Any) -> int:  # noqa: N802
        out._obj.value = self.text
        return 0

    def cuDriverGetVersion(self, out: Any) -> int:  # noqa: N802
        out._obj.value = 13000
        return 0


def test_the_probe_script_reads_cuinits_error_in_cudas_own_words() -> None:
    lib = FakeLibcuda(802, b"CUDA_ERROR_SYSTEM_NOT_READY", b"system not yet initialized")
    assert probe_script.cuda_init(lib) == (802, "CUDA_ERROR_SYSTEM_NOT_READY: system not yet initialized")
    assert probe_script.cuda_init(FakeLibcuda(0, b"", b"")) == (0, None)
    assert probe_script.driver_cuda(lib) == 13000


def test_a_device_file_the_jobs_user_cannot_open_fails_the_probe(
        shared_tmp: Path, run_as_nobody: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """As `nobody` (root opens anything): a verbs device of mode 600 is named, one of mode 666 is not."""
    for name, mode in (("uverbs0", 0o600), ("uverbs1", 0o666)):
        (shared_tmp / name).touch()
        (shared_tmp / name).chmod(mode)
    code = f"from trainer.gpuprobe import unopenable; print(unopenable(({str(shared_tmp / 'uverbs*')!r},)))"
    done = run_as_nobody(["-c", code], shared_tmp)
    assert done.stdout.strip() == repr([f"{shared_tmp / 'uverbs0'}: Permission denied"]), done.stderr
    facts = ProbeFacts(torch="2.9", cuda="13.0", driver_cuda=13000, count=8, kernel="ok",
                       denied=("/dev/infiniband/uverbs0: Permission denied",))
    assert judge(facts, 8, "1000:1000") == (
        "the job's user (uid:gid 1000:1000) cannot open /dev/infiniband/uverbs0: Permission denied; give it access "
        "to these devices on the host (their group, or a udev rule), since the job runs as that user, not as root")


def test_a_newer_driver_minor_version_is_not_blamed() -> None:
    """CUDA 12.x runs on any 12.x driver (minor version compatibility): a count of 0 there is another cause."""
    facts = ProbeFacts(torch="2.5.0", cuda="12.4", driver_cuda=12060, driver="560.35", count=0, warning="boom")
    assert "0 GPU(s) usable in the container, 1 needed (boom)" in str(judge(facts, 1))


def test_cpu_torch_no_driver_fewer_gpus_and_a_failing_kernel() -> None:
    assert "is a CPU build (no CUDA)" in str(judge(ProbeFacts(torch="2.13.0+cpu"), 1))
    assert "torch does not import" in str(judge(ProbeFacts(warning="import torch: ModuleNotFoundError"), 1))
    assert "no CUDA in the container" in str(judge(ProbeFacts(torch="2.9", cuda="13.0"), 1))
    four = ProbeFacts(torch="2.9", cuda="13.0", driver_cuda=13000, count=4, kernel="ok")
    assert judge(four, 8) == "4 GPU(s) usable in the container, 8 needed; lower --gpus or slots="
    broken = ProbeFacts(torch="2.9", cuda="13.0", driver_cuda=13000, count=8,
                        kernel="AcceleratorError: CUDA error: no kernel image is available for execution on the device")
    assert judge(broken, 8) == ("a test kernel failed on the GPUs: AcceleratorError: CUDA error: no kernel image "
                                "is available for execution on the device")
    assert "printed no answer" in str(judge(None, 1))


def test_failures_are_one_line_per_host() -> None:
    results = [ProbeResult("a", None, "ok"), ProbeResult("b", "x is wrong", "x is wrong"),
               ProbeResult("c", "y is wrong", "y is wrong")]
    with pytest.raises(PreflightError) as err:
        gpuprobe.require(results)
    assert str(err.value).splitlines()[1:] == ["  b: x is wrong", "  c: y is wrong"]
    gpuprobe.require(results[:1])


def test_the_node_needs_one_gpu_per_process() -> None:
    specs = job_specs(UpConfig.of(ssh=SSH, gpus=4), [HOST], "10.0.0.1")
    assert gpuprobe.need_of(specs[0]) == 4
    assert sdk_kwargs(specs[0])["device_requests"][0]["Count"] == 4


class FakeContainer:
    def __init__(self, client: FakeClient) -> None:
        self.client = client

    def start(self) -> None:
        if self.client.start_error:
            raise docker.errors.APIError("500 Server Error", explanation=self.client.start_error)

    def wait(self, timeout: float) -> dict[str, int]:
        return {"StatusCode": 0}

    def logs(self, stdout: bool, stderr: bool) -> bytes:
        return (NGC_BANNER + self.client.answer).encode()

    def remove(self, force: bool) -> None:
        self.client.removed += 1


class FakeClient:
    """A node's Docker daemon as the probe uses it: create, start, wait, logs, remove."""

    def __init__(self, answer: str, start_error: str = "") -> None:
        self.answer, self.start_error = answer, start_error
        self.created: list[dict[str, Any]] = []
        self.removed = 0
        self.containers = self

    def create(self, image: str, **kwargs: Any) -> FakeContainer:
        self.created.append(kwargs)
        return FakeContainer(self)


def probe_node(client: FakeClient, spec: ContainerSpec, image_id: str | None, state: str | None) -> ProbeResult:
    """The probe of the job's container `spec` as the plan makes it (plan/shortlived.py)."""
    return gpuprobe.probe_node(lambda probe: run_one(client, probe, gpuprobe.PROBE_TIMEOUT_S), spec,
                               gpu_probe(spec, gpuprobe.script()), image_id, state)


def answer(facts: ProbeFacts) -> str:
    return json.dumps({k: getattr(facts, k) for k in GPU_PROBE_FIELDS})


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_a_pass_is_remembered_per_image_id_and_host_a_failure_is_not() -> None:
    spec = job_specs(UpConfig.of(ssh=SSH, gpus=8), [HOST], "10.0.0.1")[0]
    state = gpuprobe.node_state(BOOT + DRIVER_580)
    good = FakeClient(answer(GOOD))
    assert probe_node(good, spec, "sha256:aa", state).problem is None
    assert probe_node(good, spec, "sha256:aa", state).problem is None
    assert len(good.created) == 1 and good.removed == 1
    probe_node(good, spec, "sha256:bb", state)  # another image: probed again
    assert len(good.created) == 2
    other_host = job_specs(UpConfig.of(ssh=SSH, gpus=8), [Host(name="gpu2", hostname="10.0.0.2", port=22,
                                                               user="u", slots=None)], "10.0.0.1")[0]
    probe_node(good, other_host, "sha256:aa", state)
    assert len(good.created) == 3
    bad = FakeClient(answer(ProbeFacts(torch="2.13.0+cpu")))
    for _ in range(2):
        assert "CPU build" in str(probe_node(bad, spec, "sha256:cc", state).problem)
    assert len(bad.created) == 2


def test_a_reboot_or_a_driver_change_probes_again_and_finds_the_fabric_manager_down() -> None:
    """The pass of the last boot says nothing of this one: after a reboot the fabric manager may not be up."""
    spec = job_specs(UpConfig.of(ssh=SSH, gpus=8), [HOST], "10.0.0.1")[0]
    before = gpuprobe.node_state(BOOT + DRIVER_580)
    assert probe_node(FakeClient(answer(GOOD)), spec, "sha256:aa", before).problem is None
    rebooted = gpuprobe.node_state("0d9e2b11-7a44-4f0e-b1c2-99aa01f3e5d7\n" + DRIVER_580)
    fm_down = FakeClient(FM_DOWN)
    assert "is nvidia-fabricmanager running?" in str(probe_node(fm_down, spec, "sha256:aa", rebooted).problem)
    new_driver = gpuprobe.node_state(BOOT + DRIVER_580.replace("580.82.07", "580.95.05"))
    probe_node(fm_down, spec, "sha256:aa", new_driver)
    probe_node(fm_down, spec, "sha256:aa", None)  # the host's state unknown: never from memory
    assert len(fm_down.created) == 3
    assert gpuprobe.node_state("cat: /proc/sys/kernel/random/boot_id: No such file or directory\n") is None


def test_the_probe_runs_as_the_jobs_user_with_its_devices_and_is_removed_when_its_start_fails() -> None:
    config = UpConfig.of(ssh=SSH, gpus=2, nccl_transport="ib")
    spec = job_specs(config, [HOST], "10.0.0.1", [NodeFacts(user="1000:1000", login="alice", ib=True)])[0]
    client = FakeClient("", start_error=DOCKER_NO_RUNTIME)
    result = probe_node(client, spec, None, None)
    assert result.problem is not None and result.problem.startswith("no NVIDIA container runtime")
    assert client.removed == 1
    job, probe = sdk_kwargs(spec), client.created[0]
    assert probe["user"] == "1000:1000" and probe["devices"] == ["/dev/infiniband"] and probe["cap_add"]
    for key in ("user", "device_requests", "devices", "cap_add", "ulimits"):
        assert probe[key] == job[key], key
    assert probe["environment"] == {"HOME": "/tmp", "USER": "alice", "LOGNAME": "alice"}
    assert probe["command"][:2] == ["python3", "-c"]
    assert "entrypoint" not in probe  # through the image's own: NGC's CUDA compat setup runs
