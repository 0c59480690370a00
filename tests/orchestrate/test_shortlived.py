"""Every container of an attempt is in its plan (plan/shortlived.py): the image check, and per node the GPU probe, the
data fetch and the network check, each printed by `--dry-run=hosts --json` as exactly what the daemon is given."""

from __future__ import annotations

import json

from kit.units import HOSTS, SSH, gpu_facts, job_plan

from orchestrate.backends.docker_ssh import DockerSSH
from orchestrate.backends.docker_ssh.request import plan_json, render_job_plan, sdk_kwargs
from orchestrate.config import UpConfig
from orchestrate.labels import DATA_MARKER, IMAGE_CHECK_LABEL, JOB_LABEL, PREFETCH_LABEL, owner_labels
from orchestrate.pipeline.attempt import short_scripts
from orchestrate.plan import shortlived
from orchestrate.plan.jobplan import Attempt, JobPlan
from trainer.contract import ARCHIVE_NAME, BASE_FOLDER

DIRS = {"data": "/home/u/data", "ckpt": "/home/u/ck", "log": "/home/u/logs"}
URL = "https://alice:s3cret@example.org/cifar.tar.gz"
SCRIPTS = short_scripts(DockerSSH())


FIRST = Attempt()


def planned(attempt: Attempt = FIRST, **kw: object) -> JobPlan:
    config = UpConfig.of(ssh=SSH, job="p", image="img:1", data_url=URL, **kw)  # type: ignore[arg-type]
    facts = [gpu_facts(2, (0, 1), iface="eth0", addr=f"10.0.0.{i + 11}", dirs=DIRS, user="1000:1000", login="alice")
             for i in range(2)]
    plan = job_plan(config, attempt, HOSTS, "10.0.0.11", facts, None, ("torchrun",))
    check = shortlived.image_check(config.program, HOSTS[0], SCRIPTS)
    return shortlived.with_short_containers(plan, config.program, config.resources, config.data, config.checks, SCRIPTS,
                                              check, "here")


def test_every_container_of_a_gpu_attempt_is_planned_and_printed_as_the_daemon_gets_it() -> None:
    plan = planned(gpus=2, check_network=True)
    data = json.loads(json.dumps(plan_json(plan)))  # JSON as printed
    for node, printed in zip(plan.nodes, data["nodes"], strict=True):
        assert node.gpu_probe is not None and node.fetch is not None and node.network_check is not None
        for key, spec in (("gpu_probe", node.gpu_probe), ("fetch", node.fetch), ("network_check", node.network_check)):
            kwargs = {k: v for k, v in sdk_kwargs(spec).items() if k not in ("detach", "environment")}
            assert {k: v for k, v in printed[key]["container"].items() if k != "environment"} == \
                json.loads(json.dumps(kwargs)), key
            assert printed[key]["docker_run"][:2] == ["docker", "run"]
        probe = printed["gpu_probe"]["container"]
        assert probe["network_mode"] == "none" and probe["device_requests"] == printed["container"]["device_requests"]
        assert probe["labels"] == {**owner_labels("1000:1000", "alice"), JOB_LABEL: "p-gpuprobe"}
        assert printed["network_check"]["container"]["labels"][JOB_LABEL] == "p-netcheck"
    fetch = data["nodes"][1]["fetch"]
    # What the fetch container was given before it was planned (backends/docker_ssh/data.py), now from the plan.
    assert fetch["container"]["command"][:2] == ["python", "-c"]
    assert fetch["container"]["command"][3:] == [plan.nodes[1].fetch.command[3], "/data", ARCHIVE_NAME,  # type: ignore[union-attr]
                                                 BASE_FOLDER, DATA_MARKER]
    assert (fetch["container"]["network_mode"], fetch["container"]["user"]) == ("host", "1000:1000")
    assert fetch["container"]["mounts"] == [{"Target": "/data", "Source": DIRS["data"], "Type": "bind",
                                             "ReadOnly": False}]
    assert fetch["container"]["labels"] == {PREFETCH_LABEL: "p", **owner_labels("1000:1000", "alice")}
    assert plan.nodes[1].fetch.env["DATA_URL"] == URL  # type: ignore[union-attr]  # the node gets the real one
    assert fetch["container"]["environment"]["DATA_URL"] == "https://****@example.org/cifar.tar.gz"
    assert "s3cret" not in json.dumps(data) and "s3cret" not in render_job_plan(plan)
    check = data["image_check"]
    assert check["runs_on"] == "here" and check["container"]["entrypoint"][:2] == ["sh", "-c"]
    assert check["container"]["labels"] == {IMAGE_CHECK_LABEL: "p"} and check["container"]["network_mode"] == "none"
    run = check["docker_run"]
    assert "--entrypoint=sh" in run and run[run.index("img:1") + 1] == "-c" and run[-2:] == ["module", "trainer"]


def test_a_cpu_attempt_with_its_data_present_runs_no_short_container_but_the_image_check() -> None:
    plan = planned(gpus=0, data_from=None)
    assert [n.fetch is not None for n in plan.nodes] == [True, True]  # no verified copy yet: fetched
    present = planned(gpus=0, entry="-m app.main")  # another program: it finds its own data
    assert all(n.gpu_probe is None and n.fetch is None and n.network_check is None for n in present.nodes)
    assert present.image_check is not None and present.image_check.command == ("module", "app.main")
    data = plan_json(present)
    assert [(n["gpu_probe"], n["fetch"], n["network_check"]) for n in data["nodes"]] == [(None, None, None)] * 2
    restart = planned(Attempt(1, "node 1 exited", resume=True), gpus=0, check_network=True)
    assert all(n.network_check is None for n in restart.nodes)  # the network is checked on the first start only
