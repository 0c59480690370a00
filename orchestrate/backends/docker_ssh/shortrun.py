"""The plan's short containers (plan/shortlived.py) run to their end over each host's Docker API, then removed:
the GPU probe and `check`'s self-test one by one, the network check's all together (they meet each other)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from orchestrate.backends.docker_ssh.control import kill_on_host, uid_of
from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.backends.docker_ssh.start import start_containers
from orchestrate.backends.protocol import ShortRunResult
from orchestrate.fanout import fan_out
from orchestrate.labels import JOB_LABEL
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.remote.session import Session


def run(nodes: Session, specs: Mapping[int, ContainerSpec], timeout: float, what: str,
        together: bool) -> dict[int, ShortRunResult]:
    ranks = sorted(specs)
    if together:
        assert ranks == list(range(len(nodes.hosts)))  # one per node: they meet each other
        return dict(enumerate(_together(nodes, [specs[r] for r in ranks], timeout, what)))
    ran = fan_out(what, ranks, lambda r: run_one(nodes.docker(r, timeout=timeout), specs[r], timeout),
                  lambda r: specs[r].host.label)
    return dict(zip(ranks, ran, strict=True))


def run_one(client: Any, spec: ContainerSpec, timeout: float) -> ShortRunResult:
    """Created, started, waited for, read and removed here (a container whose start failed would stay behind);
    one the daemon refuses to create or start is a ShortRunResult with its error, in the daemon's words."""
    import docker.errors

    kwargs = sdk_kwargs(spec)
    kwargs.pop("detach")
    try:
        container = client.containers.create(**kwargs)
    except docker.errors.APIError as err:
        return ShortRunResult(None, error=str(err.explanation or err))
    try:
        container.start()
        return ended(container, timeout)
    except docker.errors.APIError as err:
        return ShortRunResult(None, error=str(err.explanation or err))
    finally:
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)


def ended(container: Any, timeout: float) -> ShortRunResult:
    """Wait (bounded) for a started container's end; its exit code and output."""
    status = container.wait(timeout=timeout)
    return ShortRunResult(int(status.get("StatusCode", -1)),
                          container.logs(stdout=True, stderr=True).decode(errors="replace"),
                          container.logs(stdout=True, stderr=False).decode(errors="replace"))


def _together(nodes: Session, specs: list[ContainerSpec], timeout: float, what: str) -> list[ShortRunResult]:
    """All created, then all started (start_containers: none is left if one fails); each waited for, then every
    container of their job label stopped and removed on every node."""
    def label(r: int) -> str:
        return specs[r].host.label

    ranks = list(range(len(specs)))
    containers = start_containers(nodes, specs)
    try:
        return fan_out(what, ranks, lambda r: ended(containers[r], timeout), label)
    finally:
        fan_out(f"{what} cleanup", ranks,
                lambda r: kill_on_host(nodes.docker(r), specs[r].labels[JOB_LABEL], 0, label(r), uid_of(nodes, r)),
                label)
