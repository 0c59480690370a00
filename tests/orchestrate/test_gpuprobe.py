"""The GPU probe's decisions, on the texts real nodes give, and its memory per image ID and host. The texts:
Docker's 'could not select device driver "" with capabilities: [[gpu]]' (NVIDIA/nvidia-docker#1034, #1352),
torch's 'CUDA initialization: The NVIDIA driver on your system is too old (found version 12080) ...'
(pytorch/pytorch#162531), NGC's entrypoint banner before the answer. The hosts here have no GPU: a fake Docker
client stands for a node in the memory tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from orchestrate.config import SSHOptions, UpConfig
from orchestrate.errors import PreflightError
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import build_plan
from orchestrate.probe import gpuprobe
from orchestrate.probe.gpuprobe import ProbeFacts, ProbeResult, judge, launch_problem, parse
from trainer.contract import GPU_PROBE_FIELDS

SSH = SSHOptions(Path("hosts"), None, False)
HOST = Host(name="gpu1", hostname="10.0.0.1", port=22, user="u", slots=None)
GOOD = ProbeFacts(arch="x86_64", torch="2.9.0a0+nv25.10", cuda="13.0", driver_cuda=13000, driver="580.82.07",
                  count=8, nccl="2.27.7", kernel="ok")
TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12080). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org/ to install a "
           "PyTorch version that has been compiled with your version of the CUDA driver.")
DOCKER_NO_RUNTIME = 'could not select device driver "" with capabilities: [[gpu]]'
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
    specs = build_plan(UpConfig(ssh=SSH, gpus=4), [HOST], "10.0.0.1")
    assert gpuprobe.need_of(specs[0]) == 4
    assert specs[0].sdk_kwargs()["device_requests"][0]["Count"] == 4


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


def answer(facts: ProbeFacts) -> str:
    return json.dumps({k: getattr(facts, k) for k in GPU_PROBE_FIELDS})


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_a_pass_is_remembered_per_image_id_and_host_a_failure_is_not() -> None:
    spec = build_plan(UpConfig(ssh=SSH, gpus=8), [HOST], "10.0.0.1")[0]
    good = FakeClient(answer(GOOD))
    assert gpuprobe.probe_node(good, spec, "sha256:aa").problem is None
    assert gpuprobe.probe_node(good, spec, "sha256:aa").problem is None
    assert len(good.created) == 1 and good.removed == 1
    gpuprobe.probe_node(good, spec, "sha256:bb")  # another image: probed again
    assert len(good.created) == 2
    other_host = build_plan(UpConfig(ssh=SSH, gpus=8), [Host(name="gpu2", hostname="10.0.0.2", port=22,
                                                             user="u", slots=None)], "10.0.0.1")[0]
    gpuprobe.probe_node(good, other_host, "sha256:aa")
    assert len(good.created) == 3
    bad = FakeClient(answer(ProbeFacts(torch="2.13.0+cpu")))
    for _ in range(2):
        assert "CPU build" in str(gpuprobe.probe_node(bad, spec, "sha256:cc").problem)
    assert len(bad.created) == 2


def test_the_probe_runs_with_the_jobs_device_request_and_is_removed_when_its_start_fails() -> None:
    spec = build_plan(UpConfig(ssh=SSH, gpus=2), [HOST], "10.0.0.1")[0]
    client = FakeClient("", start_error=DOCKER_NO_RUNTIME)
    result = gpuprobe.probe_node(client, spec, None)
    assert result.problem is not None and result.problem.startswith("no NVIDIA container runtime")
    assert client.removed == 1
    assert client.created[0]["device_requests"] == spec.sdk_kwargs()["device_requests"]
    assert client.created[0]["command"][:2] == ["python3", "-c"]
    assert "entrypoint" not in client.created[0]  # through the image's own: NGC's CUDA compat setup runs
