"""Plan and apply the image phase of a first `up` on every host of a hosts file, and nothing else: print the plan's
image line per node (as `--dry-run=hosts` does), then deliver the image as `up` does.

The cluster test's image is built on a tiny base with no Python, which `up`'s image check would refuse before
the image phase; the phase itself needs none. It runs as the pipeline does: connect and preflight, the facts, the
pure plan, then `ensure_images`, with the orchestrator's environment (HOME: the test cluster's ssh config).
argv: HOSTS_FILE IMAGE.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from orchestrate.backends.choice import scheduler
from orchestrate.backends.docker_ssh.image import ensure_images
from orchestrate.backends.docker_ssh.request import render_job_plan
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import parse_hosts_file
from orchestrate.pipeline.ready import connect_and_preflight
from orchestrate.plan.jobplan import Attempt, PlanInputs, plan_job
from orchestrate.probe.facts import node_facts
from orchestrate.probe.observations import Launcher
from orchestrate.timings import Timings


def main(hosts_file: str, image: str) -> None:
    hosts = parse_hosts_file(Path(hosts_file), None)
    config = UpConfig.of(ssh=SSHOptions(Path(hosts_file), None, False), image=image, gpus=0, job="image-phase-test")
    console = Console(highlight=False, emoji=False, width=200)  # as the CLI's when its output is not a terminal
    ready = connect_and_preflight(scheduler(), config, Attempt(), hosts, console, Timings())
    try:
        local = ready.scheduler.local_layers(ready.local, ready.local_id)
        facts = node_facts(ready.scheduler, ready.nodes, ready.reports, config.delivery, config.data if config.program.is_trainer else None, local)
        plan = plan_job(PlanInputs(config.program, config.resources, config.where, config.data, config.delivery,
                                   Attempt(), tuple(ready.nodes.hosts), ready.master, tuple(facts), local, Launcher()))
        for line in render_job_plan(plan).splitlines():
            if line.startswith(("# node", "#   image:")):
                print(line, flush=True)
        ensure_images(ready.nodes, plan, ready.local, ready.local_id, console, config.delivery.layer_cache)
    finally:
        ready.nodes.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
