"""Stand-ins shared by the orchestrator's unit tests: SSH options, hosts and a command line no test connects with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchestrate import cli
from orchestrate.config import Resources, SSHOptions, UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.gpuset import GpuSet, decide_gpus
from orchestrate.plan.jobplan import Attempt, ContainerSpec, JobPlan, PlanInputs, container_specs, plan_job
from orchestrate.plan.verdicts import judge_gpus
from orchestrate.probe.observations import (
    Check,
    CheckResult,
    GpuSeen,
    Holdings,
    Launcher,
    LocalImage,
    NodeFacts,
    gpu_seen,
)

SSH = SSHOptions(Path("hosts"), None, False)  # a hosts file that is never read
HOSTS = [Host(name="gpu1", hostname="10.0.0.11", port=22, user="u", slots=None),
         Host(name="gpu2", hostname="10.0.0.12", port=22, user="u", slots=None)]


def parse(*argv: str) -> UpConfig:
    """`up --hosts hosts ARGV` as the command line parses it."""
    _, cfg = cli.parse_args(["up", "--hosts", "hosts", *argv])
    assert isinstance(cfg, UpConfig)
    return cfg


def job_specs(config: UpConfig, hosts: Sequence[Host], master_addr: str, facts: Sequence[NodeFacts] | None = None,
              launcher: Sequence[str] | Launcher = ("torchrun",), attempt: Attempt | None = None) -> list[ContainerSpec]:
    """The planner's containers for a whole config, handed its sections as the pipeline hands them (`attempt`
    None: the first start, with --resume as the config says; `launcher`: torchrun's argv alone, or the image's)."""
    return container_specs(plan_inputs(config, attempt if attempt is not None else Attempt.first(config.resilience),
                                       hosts, master_addr, facts, launcher=launchers(launcher)))


def launchers(launcher: Sequence[str] | Launcher) -> Launcher:
    """An image's launchers: torchrun's argv alone (an image without trainer.launch), or as given."""
    return launcher if isinstance(launcher, Launcher) else Launcher(tuple(launcher))


def job_plan(config: UpConfig, attempt: Attempt, hosts: Sequence[Host], master_addr: str, facts: Sequence[NodeFacts],
             local: LocalImage | None, launcher: Sequence[str] | Launcher | None,
             verdicts: Sequence[tuple[CheckResult, ...]] | None = None) -> JobPlan:
    """The planner's JobPlan for a whole config (no resume point), handed its sections as the pipeline hands them."""
    return plan_job(plan_inputs(config, attempt, hosts, master_addr, facts, local=local,
                                launcher=launchers(launcher) if launcher is not None else None,
                                verdicts=tuple(verdicts) if verdicts is not None else None))


def plan_inputs(config: UpConfig, attempt: Attempt, hosts: Sequence[Host], master_addr: str,
                facts: Sequence[NodeFacts] | None = None, **observed: object) -> PlanInputs:
    """The planner's inputs for a whole config: its sections as the pipeline takes them, and what was `observed`
    (PlanInputs' other fields)."""
    return PlanInputs(config.program, config.resources, config.where, config.data, config.delivery, attempt,  # type: ignore[arg-type]
                      tuple(hosts), master_addr, tuple(facts) if facts is not None else None, **observed)


def gpus_judged(probed: dict[str, str], resources: Resources, slots: int | None = None,
                holdings: Holdings | None = None, host: Host | None = None) -> tuple[GpuSet, Check]:
    """The GPU set a node gets and preflight's `gpus` cell, from the probe script's records (`probed`) as
    pipeline/preflight.py judges them: nvidia-smi is asked only for a GPU job."""
    where = host if host is not None else Host(name="h0", hostname="10.0.0.9", port=22, user=None, slots=slots)
    seen = (gpu_seen(probed) or GpuSeen("missing")) if resources.gpus else None
    decided = decide_gpus(resources, where, seen, holdings if holdings is not None else Holdings())
    return decided, judge_gpus(decided)


def gpu_facts(count: int, ids: Sequence[int], **fields: object) -> NodeFacts:
    """A node's facts where nvidia-smi listed `count` GPUs, of which this job holds `ids` (its containers' label):
    the plan, asked again, keeps them (the rest held by nobody)."""
    listed = "\n".join(f"{i}, GPU-{i}" for i in range(count))
    return NodeFacts(gpu=GpuSeen("ok", count, listed), holdings=Holdings(own_gpus=tuple(ids)), **fields)  # type: ignore[arg-type]
