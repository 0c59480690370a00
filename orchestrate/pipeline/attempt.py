"""The I/O that feeds an attempt's JobPlan: what the read-only probe finds (the nodes' layers and data), the resume
checkpoint, the image's launcher; then the pure plan_job."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from orchestrate.backends.protocol import NodesT, Scheduler
from orchestrate.checks import gpuprobe, netcheck
from orchestrate.config import UpConfig
from orchestrate.errors import NoCheckpointError
from orchestrate.pipeline.ready import PreflightedHosts
from orchestrate.plan import shortlived
from orchestrate.plan.jobplan import Attempt, ContainerSpec, JobPlan, PlanInputs, plan_job
from orchestrate.plan.resume import ResumePoint, choose_resume, resume_line
from orchestrate.probe.facts import local_data, node_facts
from orchestrate.probe.imagecheck import CHECK_IMAGE, FIND_PYTHON, check_image
from orchestrate.probe.observations import CheckResult, HostReport, Launcher
from orchestrate.probe.resume import newest_checkpoints
from orchestrate.timings import Timings
from trainer.contract import ENV_RESUME


def plan_attempt(config: UpConfig, attempt: Attempt, ready: PreflightedHosts[NodesT], console: Console, timings: Timings,
                 on_hosts: bool = True) -> tuple[JobPlan, PlanInputs]:
    """The attempt's plan, from what the read-only probe finds: the nodes' layers and data, the resume checkpoint,
    the launcher (`on_hosts` False: no check container on a host, as for a dry run); and the inputs it was built
    from (a lost GPU/port claim plans again from them: backends/docker_ssh/claim.py)."""
    with timings.phase("plan"):
        image = ready.scheduler.local_layers(ready.local, ready.local_id)
        facts = node_facts(ready.scheduler, ready.nodes, ready.reports, config.delivery, config.data if config.program.is_trainer else None, image)
        resume, attempt = _resume(ready, config, attempt, console) if attempt.resume else (None, attempt)
        archive_bytes, from_folder = local_data(config.data)
        scripts = short_scripts(ready.scheduler)
        check = shortlived.image_check(config.program, ready.hosts[0], scripts)
        launcher, on = _launcher(config, ready, on_hosts, check)
        inputs = PlanInputs(config.program, config.resources, config.where, config.data, config.delivery, attempt,
                            tuple(ready.hosts), ready.master, tuple(facts), image, launcher, resume,
                            archive_bytes, from_folder, ready.port, tuple(_verdicts(r) for r in ready.reports))
        return shortlived.with_short_containers(plan_job(inputs), config.program, config.resources, config.data,
                                                config.checks, scripts, check, on), inputs


def _verdicts(report: HostReport) -> tuple[CheckResult, ...]:
    """Preflight's verdicts on a host, in the table's order, as the plan carries them."""
    return tuple(CheckResult(name, c.ok, c.text, c.warn) for name, c in report.checks.items())


def short_scripts(scheduler: Scheduler[NodesT]) -> shortlived.Scripts:
    """The programs the short containers run, as sent (the data fetch's is the scheduler's: it reads its output)."""
    return shortlived.Scripts(gpu_probe=gpuprobe.script(), network_check=netcheck.script(), fetch=scheduler.fetch_script(),
                              find_python=FIND_PYTHON, check_image=CHECK_IMAGE)


def _launcher(config: UpConfig, ready: PreflightedHosts[NodesT], on_hosts: bool,
              check: ContainerSpec) -> tuple[Launcher | None, str]:
    """How the job's processes start in the image the nodes will run, checked before anything is sent (the plan's image
    check container): on this machine's daemon when the nodes run its image (same ID), else on node 0 where it
    keeps its own; None when node 0 has still to pull it (then it is checked after the pull). And where the check
    would run ("" when it does not: node 0 pulls the image first; a check remembered runs nothing)."""
    node0, here = ready.reports[0].image_id, ready.local_id
    memo_id = None if config.delivery.pull else here  # a pulled image may differ from a local one of the same name
    if here is not None and (not config.delivery.pull or node0 == here):
        return check_image(config.program, memo_id, lambda: ready.scheduler.image_check(ready.nodes, check, ready.local)), "here"
    if node0 is not None and on_hosts:
        return (check_image(config.program, memo_id, lambda: ready.scheduler.image_check(ready.nodes, check, None)),
                ready.hosts[0].label)
    return None, ""


def _resume(ready: PreflightedHosts[NodesT], config: UpConfig, attempt: Attempt,
            console: Console) -> tuple[ResumePoint | None, Attempt]:
    """The checkpoint this attempt resumes from, and the attempt as it runs (a restart before the first
    checkpoint starts over)."""
    labels, ckpt_dirs = [h.label for h in ready.hosts], [r.dirs["ckpt"] for r in ready.reports]
    try:
        point = choose_resume(newest_checkpoints(ready.scheduler, ready.nodes, labels, ckpt_dirs, console), labels,
                              ckpt_dirs)
        console.print(resume_line(point), markup=False, highlight=False)
        return point, attempt
    except NoCheckpointError:
        if config.program.is_trainer and attempt.number:
            # The failure came before the first checkpoint: nothing is lost by starting over.
            console.print(f"restart {attempt.number}: no checkpoint was written before the failure; training "
                          "starts again from the beginning", markup=False, highlight=False)
            return None, dataclasses.replace(attempt, resume=False)
        if config.program.is_trainer:
            raise
        # Another program that writes no manifest (docs/DESIGN.md §7) finds its own state: RESUME=1 only.
        console.print(f"--resume: no valid checkpoint (manifest and matching .pt); the program gets {ENV_RESUME}=1 and "
                      "finds its own state (resume by flag only)", markup=False, highlight=False)
        return None, attempt
