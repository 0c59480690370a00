"""Stand-ins shared by the orchestrator's unit tests: SSH options, hosts and a command line no test connects with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchestrate import cli
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt, ContainerSpec, JobPlan, container_specs, plan_job
from orchestrate.probe.observations import LocalImage, NodeFacts

SSH = SSHOptions(Path("hosts"), None, False)  # a hosts file that is never read
HOSTS = [Host(name="gpu1", hostname="10.0.0.11", port=22, user="u", slots=None),
         Host(name="gpu2", hostname="10.0.0.12", port=22, user="u", slots=None)]


def parse(*argv: str) -> UpConfig:
    """`up --hosts hosts ARGV` as the command line parses it."""
    _, cfg = cli.parse_args(["up", "--hosts", "hosts", *argv])
    assert isinstance(cfg, UpConfig)
    return cfg


def job_specs(config: UpConfig, hosts: Sequence[Host], master_addr: str, facts: Sequence[NodeFacts] | None = None,
              launcher: Sequence[str] = ("torchrun",), attempt: Attempt | None = None) -> list[ContainerSpec]:
    """The planner's containers for a whole config, handed its sections as the pipeline hands them (`attempt`
    None: the first start, with --resume as the config says)."""
    return container_specs(config.program, config.resources, config.where,
                           attempt if attempt is not None else Attempt.first(config.resilience), hosts, master_addr,
                           facts, launcher)


def job_plan(config: UpConfig, attempt: Attempt, hosts: Sequence[Host], master_addr: str, facts: Sequence[NodeFacts],
             local: LocalImage | None, launcher: Sequence[str] | None) -> JobPlan:
    """The planner's JobPlan for a whole config (no resume point), handed its sections as the pipeline hands them."""
    return plan_job(config.program, config.resources, config.where, config.data, config.delivery, attempt, hosts,
                    master_addr, facts, local, launcher, None)
