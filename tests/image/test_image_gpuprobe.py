"""The real GPU probe script in the CPU image, as a GPU job's probe runs it (python3 -c, the image's entrypoint):
its answer parses and the decision names the CPU build of torch. A pass needs a GPU node (docs/gpu-nodes.md)."""

from __future__ import annotations

import docker
import pytest
from kit.image_helpers import run

from orchestrate.checks import gpuprobe

pytestmark = pytest.mark.docker


def test_the_probe_in_the_cpu_image_says_its_torch_has_no_cuda(docker_client: docker.DockerClient,
                                                                cpu_image: str) -> None:
    done = run(docker_client, cpu_image, ["python3", "-c", gpuprobe.script()], network_mode="none")
    assert done.exit_code == 0, done.logs
    facts = gpuprobe.parse(done.logs)
    assert facts is not None and facts.torch and facts.cuda is None and facts.count == 0, done.logs
    assert facts.arch == "x86_64" and facts.driver_cuda is None
    assert str(gpuprobe.judge(facts, 1)).startswith(f"the image's torch {facts.torch} is a CPU build (no CUDA)")
