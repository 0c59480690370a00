"""Run the GPU probe of a GPU job (--gpus 1) on every host of a hosts file and print one JSON line per host.

`up --gpus 1` cannot reach the probe on the test hosts (preflight stops first: they have no nvidia-smi), so the
cluster test runs the probe itself, as the pipeline does, with the orchestrator's environment (HOME: the test
cluster's ssh config). argv: HOSTS_FILE IMAGE.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from orchestrate.backends.choice import scheduler
from orchestrate.checks import gpuprobe
from orchestrate.config import SSHOptions, UpConfig
from orchestrate.hosts import parse_hosts_file
from orchestrate.plan.jobplan import Attempt, PlanInputs, container_specs
from orchestrate.plan.shortlived import gpu_probe
from orchestrate.remote.session import Session


def main(hosts_file: str, image: str) -> None:
    hosts = parse_hosts_file(Path(hosts_file), None)
    config = UpConfig.of(ssh=SSHOptions(Path(hosts_file), None, False), image=image, gpus=1, job="gpuprobe-test")
    nodes = Session.connect(hosts, False)
    try:
        specs = container_specs(PlanInputs(config.program, config.resources, config.where, config.data,
                                           config.delivery, Attempt(), tuple(hosts), hosts[0].hostname))
        for result in gpuprobe.probe_all(scheduler(), nodes, specs, [gpu_probe(s, gpuprobe.script()) for s in specs], None):
            print(json.dumps(dataclasses.asdict(result)), flush=True)
    finally:
        nodes.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
