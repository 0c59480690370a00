"""The Slurm allocator's pure parts on Slurm 22.05's real outputs (recorded from the test cluster's Slurm into
data/slurm/), and the command line over stand-in Slurm clients that print those recordings: hosts and GPUs from
an allocation, submit's sbatch line and refusals. The real Slurm runs in tests/cluster/test_slurm_backend.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kit.units import SSH, gpu_facts, gpus_judged, job_specs

from orchestrate import cli
from orchestrate.backends.docker_ssh import carried
from orchestrate.backends.slurm import commands, records, script
from orchestrate.config import UpConfig
from orchestrate.errors import ConfigError, PreflightError
from orchestrate.hosts import parse_hosts_file
from orchestrate.plan.gpuset import decide_gpus
from orchestrate.plan.regrant import regrant
from orchestrate.probe.observations import Held, Holdings, NodeFacts

DATA = Path(__file__).parent / "data" / "slurm"
GPU_LIST = "0, GPU-0aaa\n1, GPU-1bbb"  # nvidia-smi --query-gpu=index,uuid of a 2-GPU node


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_job_records_give_state_reason_exit_and_the_gpus_of_each_node() -> None:
    per_node = records.parse_job(recorded("job-running-gpu-per-node.txt"))
    assert (per_node.job_id, per_node.name, per_node.user, per_node.state) == ("4", "yy", "root", "RUNNING")
    assert per_node.gpus == {"dc-slm-h0": (1,), "dc-slm-h1": (0,)}  # one Nodes= line per node: different indices
    grouped = records.parse_job(recorded("job-running-gpu-one-line.txt"))
    assert grouped.gpus == {"dc-slm-h0": (0,), "dc-slm-h1": (0,)}  # one line for both: Nodes=dc-slm-h[0-1]
    assert grouped.describe() == "RUNNING on dc-slm-h[0-1]"
    pending = records.parse_job(recorded("job-pending-resources.txt"))
    assert (pending.describe(), pending.gpus, pending.node_list) == ("PENDING (Resources)", {}, "")
    assert records.parse_job(recorded("job-failed.txt")).describe() == "FAILED (exit 3)"
    assert records.parse_job(recorded("job-completed.txt")).describe() == "COMPLETED"
    assert records.parse_job(recorded("job-cancelled.txt")).describe() == "CANCELLED (exit 0, signal 15)"
    every = records.parse_jobs(recorded("all-jobs.txt"))
    assert [r.job_id for r in every] == [str(i) for i in range(1, 14)]
    assert [r.state for r in every if r.name == "cc"] == ["COMPLETED"]


def test_typed_and_several_gres_and_hostlists_as_slurm_writes_them() -> None:
    text = ("   JOB_GRES=gpu:a100:4,nic:1\n     Nodes=n[08-10],gpu7 CPU_IDs=0-3 Mem=0 GRES=gpu:a100:2(IDX:0-1),"
            "nic:1(IDX:0)\n     Nodes=x1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:4,6)\n")
    assert records.gpus_by_node(text) == {"n08": (0, 1), "n09": (0, 1), "n10": (0, 1), "gpu7": (0, 1),
                                          "x1": (4, 6)}
    assert records.expand_hostlist("a[1-2]-ib,b,c[3,5-6]") == ["a1-ib", "a2-ib", "b", "c3", "c5", "c6"]


def test_the_allocation_is_a_hosts_file_with_each_nodes_grant(tmp_path: Path) -> None:
    """Node 0 first, in Slurm's order; `gpu_ids=` carries each node's own indices, and preflight grants exactly those."""
    grant = records.parse_job(recorded("job-running-gpu-per-node.txt")).gpus
    text, per_node = records.hosts_text("4", ["dc-slm-h0", "dc-slm-h1"], grant)
    (tmp_path / "hosts").write_text(text)
    (tmp_path / "ssh_config").write_text("")
    hosts = parse_hosts_file(tmp_path / "hosts", tmp_path / "ssh_config")
    assert per_node == 1 and [(h.name, h.gpu_ids, h.slots) for h in hosts] == [("dc-slm-h0", (1,), 1),
                                                                                ("dc-slm-h1", (0,), 1)]
    config = UpConfig.of(ssh=SSH, gpus=1, gpus_on_cpu=True)
    for host in hosts:
        decided, cell = gpus_judged({"smi": "ok", "gpus": "2", "gpu_list": GPU_LIST}, config.resources, host=host)
        assert decided.ids == host.gpu_ids and decided.held, cell
    assert records.hosts_text("9", ["a", "b"], {})[1] == 0  # no GPU granted: CPU
    for bad in ("3-1", "0,0", "1,x"):
        (tmp_path / "hosts").write_text(f"a gpu_ids={bad}\n")
        with pytest.raises(Exception, match=r"hosts:1: (gpu_ids=|bad gpu_ids value)"):
            parse_hosts_file(tmp_path / "hosts", tmp_path / "ssh_config")
    with pytest.raises(Exception, match=r"different numbers of GPUs per node \(a: 2, b: 1\)"):
        records.hosts_text("9", ["a", "b"], {"a": (0, 1), "b": (0,)})


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str = "job-running-gpu-per-node.txt") -> Path:
    """Stand-in scontrol and sbatch that print the recordings (a unit test's fake; the real Slurm is in the
    cluster test); sbatch records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\ncase "$*" in\n  "show hostnames "*) cat {DATA}/hostnames.txt ;;\n'
        f'  "show job -d 4") cat {DATA}/{job} ;;\n  "show job -d") cat {DATA}/all-jobs.txt ;;\n'
        f'  "show config") cat {DATA}/config.txt ;;\n'
        '  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;\nesac\n')
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch-args\n'
                                    'echo "sbatch: error: invalid partition specified: nope" >&2\n'
                                    'echo "sbatch: error: Batch job submission failed: Invalid partition name '
                                    'specified" >&2\nexit 1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("SLURM_JOB_ID", "4")
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    # This machine's Docker holds no image to carry (the carrying is the Slurm cluster test's subject).
    monkeypatch.setattr(carried, "local_image_id", lambda name: None)
    return tmp_path


def test_up_inside_an_allocation_takes_its_nodes_and_each_nodes_gpus(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch)
    for argv in (["up"], ["up", "--hosts", "slurm"],  # no --hosts: SLURM_JOB_ID
                 ["check", "--hosts", "slurm"]):
        _, config = cli.parse_args(argv)
        assert isinstance(config, UpConfig) and config.resources.gpus == 1
        assert config.ssh.hosts_file == tmp_path / "state" / "ddp-cifar" / "jobs" / "slurm-4.hosts"
    (tmp_path / "ssh_config").write_text("")
    hosts = parse_hosts_file(config.ssh.hosts_file, tmp_path / "ssh_config")
    specs = job_specs(config, hosts, "10.0.0.11", [NodeFacts("eth0", 2)] * 2)
    assert [s.gpu_ids for s in specs] == [(1,), (0,)]  # what --dry-run shows and Docker is asked for
    with pytest.raises(Exception, match=r"--gpus 2: Slurm granted 1 GPU\(s\) per node"):
        cli.parse_args(["up", "--gpus", "2"])


def test_no_allocation_or_no_slurm_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert cli.main(["up", "--hosts", "slurm"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --hosts slurm: SLURM_JOB_ID is not set")
    monkeypatch.setenv("SLURM_JOB_ID", "4")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli.main(["up", "--hosts", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: scontrol not found: Slurm's clients are not installed here") and "\n" not in err
    assert cli.main(["submit", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: sbatch not found")


def test_an_up_option_that_begins_like_one_of_submits_own_goes_to_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--gpus 0` is up's (CPU), not an abbreviation of submit's --gpus-per-node (it was taken for one, and lost)."""
    fake_slurm(tmp_path, monkeypatch)
    assert cli.main(["submit", "--nodes", "2", "--job", "r18", "--gpus", "0", "--python", "/usr/bin/python3",
                     "--dry-run"]) == 0
    assert f"\"$(cat {script.GUARD_SCRIPT})\" 0 --job r18 --gpus 0 --\n" in capsys.readouterr().out


def test_submit_dry_run_prints_the_script_and_submits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch)
    assert cli.main(["submit", "--nodes", "2", "--gpus-per-node", "1", "--time", "10", "--job", "r18",
                     "--max-restarts", "3", "--min-nodes", "1", "--python", "/usr/bin/python3", "--dry-run", "--",
                     "--epochs", "3"]) == 0
    out = capsys.readouterr().out
    # up's options reach the batch script's `up` as given: --max-restarts and --min-nodes work inside the
    # allocation as on a hosts file (a restart stays on the allocation's nodes)
    assert (f"sbatch --parsable --job-name=r18 --nodes=2 --no-requeue --export=ALL --signal=B:TERM@80 "
            f"--gpus-per-node=1 --time=10 {script.BATCH_SCRIPT} /usr/bin/python3 r18 20 {script.LEASE_S} "
            f"\"$(cat {script.GUARD_SCRIPT})\" 0 --job r18 --max-restarts 3 --min-nodes 1 -- --epochs 3\n") in out
    assert script.BATCH_SCRIPT.read_text() in out and out.endswith(script.GUARD_SCRIPT.read_text())
    assert not (tmp_path / "sbatch-args").exists()
    assert cli.main(["submit", "--nodes", "2", "--dry-run", "--", "--epochs", "x"]) == 2  # checked as up checks
    assert cli.main(["submit", "--nodes", "2", "--detach"]) == 2  # the job would end, its containers run on
    assert "submit: --detach would end the Slurm job" in capsys.readouterr().err


def test_a_stop_that_would_outlast_killwait_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch)
    assert records.kill_wait(recorded("config.txt")) == 30
    assert cli.main(["submit", "--nodes", "2", "--stop-grace", "26"]) == 2
    assert capsys.readouterr().err == ("error: --stop-grace 26: Slurm kills the job 30 s after its SIGTERM (KillWait), "
                                       "and the stop takes up to --stop-grace + 5 s; give at most 25\n")
    assert not (tmp_path / "sbatch-args").exists()


def test_a_time_limit_within_the_stop_signals_lead_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--signal=B:TERM@(grace + 60): a limit no longer than that lead would stop the job as it starts."""
    fake_slurm(tmp_path, monkeypatch)
    assert cli.main(["submit", "--nodes", "2", "--time", "1"]) == 2
    assert capsys.readouterr().err == ("error: --time 1: the job is asked to stop --stop-grace + 60 s (80 s) before "
                                       "its limit, so it would stop as it starts; give more than 80 s (--time 2)\n")
    assert cli.main(["submit", "--nodes", "2", "--time", "1:05", "--stop-grace", "5"]) == 2  # min:sec, lead 65 s
    assert "--time 1:05: " in capsys.readouterr().err and not (tmp_path / "sbatch-args").exists()
    # Slurm's forms, in seconds, and its words for no limit (None): 0 is no limit, not a limit too short
    forms = {"2": 120, "1:21": 81, "1:00:00": 3600, "1-2": 93600, "1-0:2": 86520, "0-0:1:30": 90, "UNLIMITED": None,
             "infinite": None, "-1": None, "0": None, "0:00": None}
    assert {t: script.limit_seconds(t) for t in forms} == forms
    for time in ("1:2:3:4", "-5", "1:", "2h", "1-2-3", ""):  # none of Slurm's forms: refused now, naming --time
        with pytest.raises(ConfigError, match=f"^--time '{time}' is not a Slurm time limit; write minutes"):
            script.limit_seconds(time)
    for time in ("1:21", "0", "UNLIMITED", "1-0"):
        assert cli.main(["submit", "--nodes", "2", "--time", time, "--dry-run"]) == 0
        assert f" --time={time} " in capsys.readouterr().out


def test_slurms_refusal_names_the_option_and_a_queued_name_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch)
    assert cli.main(["submit", "--nodes", "2", "--partition", "nope"]) == 2
    assert capsys.readouterr().err == "error: sbatch refused --partition: invalid partition specified: nope\n"
    assert "--partition=nope" in (tmp_path / "sbatch-args").read_text()
    monkeypatch.setattr("getpass.getuser", lambda: "root")
    pending = recorded("job-pending-resources.txt").replace("JobName=beta", "JobName=r18")
    (tmp_path / "queue.txt").write_text(pending)
    (tmp_path / "bin" / "scontrol").write_text(f"#!/bin/sh\ncat {tmp_path}/queue.txt\n")
    assert cli.main(["submit", "--nodes", "2", "--job", "r18"]) == 2
    assert capsys.readouterr().err == ("error: job 'r18' is already queued or running under Slurm (job 2, PENDING "
                                       "(Resources)); 'kill --job r18' first, or choose another --job\n")


def test_status_shows_slurms_state_and_kill_cancels_all_but_its_own_allocation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A job queued under Slurm has no hosts yet: status and kill answer from Slurm alone. The batch script's own
    stop (`kill` inside the job's allocation, at the time limit's SIGTERM) must not cancel that job: Slurm would
    then end the stop itself."""
    fake_slurm(tmp_path, monkeypatch)
    monkeypatch.setattr("getpass.getuser", lambda: "root")
    (tmp_path / "bin" / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scancel-args\n')
    (tmp_path / "bin" / "scancel").chmod(0o755)
    for job in ("beta", "r18"):  # as `submit` leaves them
        commands.record_submitted(tmp_path / "state" / "ddp-cifar" / "jobs", job, "2")
    assert cli.main(["status", "--job", "beta"]) == 0
    assert capsys.readouterr().out == "slurm: job 2 CANCELLED\n"  # cancelled while pending: exit 0:0
    running = recorded("job-running-gpu-per-node.txt").replace("JobName=yy", "JobName=r18")
    (tmp_path / "queue.txt").write_text(recorded("job-pending-resources.txt").replace("JobName=beta", "JobName=r18")
                                        + running)
    (tmp_path / "bin" / "scontrol").write_text(f"#!/bin/sh\ncat {tmp_path}/queue.txt\n")
    monkeypatch.setenv("SLURM_JOB_ID", "4")  # inside job 4's allocation
    assert cli.main(["kill", "--job", "r18"]) == 0
    assert (tmp_path / "scancel-args").read_text() == "2\n"
    assert capsys.readouterr().out == "slurm: cancelled job 2 (was PENDING (Resources))\n"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert cli.main(["kill", "--job", "r18"]) == 0
    assert (tmp_path / "scancel-args").read_text() == "2\n2 4\n"


def test_nodes_refusing_ssh_are_one_line_each_saying_what_the_site_must_allow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, job="job-completed.txt")
    (tmp_path / "bin" / "scontrol").write_text(
        f'#!/bin/sh\ncase "$*" in\n  "show hostnames "*) printf "127.0.0.1\\n127.0.0.2\\n" ;;\n'
        f'  *) cat {DATA}/job-completed.txt ;;\nesac\n')
    (tmp_path / "ssh_config").write_text("Host *\n  Port 1\n")  # nothing listens there: refused at once
    assert cli.main(["up", "--ssh-config", str(tmp_path / "ssh_config"), "--gpus", "0"]) == 1
    hint = "; the site must let you log in over SSH to the nodes of your own running job (pam_slurm_adopt)"
    assert capsys.readouterr().err.splitlines() == [
        "error: ssh failed on 2 host(s):",
        *(f"  {h}:1: connection to {h}:1 ({h}:1) refused; is sshd running on that port?{hint}"
          for h in ("127.0.0.1", "127.0.0.2"))]


def test_a_lost_gpu_claim_is_planned_again_within_each_nodes_slurm_grant(tmp_path: Path) -> None:
    """Another `up` took GPUs at the same moment (the claim of shared hosts): the new plan asks each node for the
    indices Slurm granted there again, never another free index of that node; a grant taken is refused, naming
    who holds it."""
    text, _ = records.hosts_text("4", ["dc-slm-h0", "dc-slm-h1"], {"dc-slm-h0": (1,), "dc-slm-h1": (3,)})
    (tmp_path / "hosts").write_text(text)
    (tmp_path / "ssh_config").write_text("")
    hosts = parse_hosts_file(tmp_path / "hosts", tmp_path / "ssh_config")
    config = UpConfig.of(ssh=SSH, gpus=1, gpus_on_cpu=True)
    facts = [gpu_facts(4, (), iface="eth0", gpus=4)] * 2  # 4-GPU nodes, one granted on each

    def bob(*gpus: int) -> Held:
        return Held("c1", "bob/other", gpus, None, "2026-01-01T00:00:00Z")

    _, new = regrant(config.resources, config.where, hosts, facts, set(), [Holdings(), Holdings([bob(0, 1)])])
    assert [decide_gpus(config.resources, h, f.gpu, f.holdings).ids for h, f in zip(hosts, new, strict=True)] == [
        (1,), (3,)]  # not the lowest free ones, 0 and 2
    with pytest.raises(PreflightError, match=r"dc-slm-h1: --gpus 3: held by bob/other"):
        regrant(config.resources, config.where, hosts, facts, set(), [Holdings(), Holdings([bob(3)])])


def test_status_and_kill_ask_slurm_only_about_a_job_submit_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A job run on a hosts file never went through Slurm: on a login node its status and kill must not wait on the
    controller (scontrol here records that it was asked)."""
    fake_slurm(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID")
    (tmp_path / "bin" / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol-asked\n')
    for command in ("status", "kill"):
        assert cli.main([command, "--job", "plain"]) == 2  # no record here: give --hosts
        assert "no record of job 'plain'" in capsys.readouterr().err
    assert not (tmp_path / "scontrol-asked").exists()


def submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[list[str], str]:
    """`submit` on a stand-in sbatch that answers job 7 and records its arguments (one a line) and its HF_TOKEN."""
    fake_slurm(tmp_path, monkeypatch)
    (tmp_path / "bin" / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {tmp_path}/sbatch-args\n'
                                             f'printf "%s" "${{HF_TOKEN:-unset}}" > {tmp_path}/sbatch-token\necho 7\n')
    assert cli.main(["submit", "--nodes", "2", *argv]) == 0
    return (tmp_path / "sbatch-args").read_text().split("\0")[:-1], (tmp_path / "sbatch-token").read_text()


def up_args(sbatch_argv: list[str]) -> list[str]:
    """The batch script's arguments after the guard's text and the options for `kill`, up to `--`."""
    count = sbatch_argv.index(script.GUARD_SCRIPT.read_text()) + 1
    start = count + 1 + int(sbatch_argv[count])
    return sbatch_argv[start:sbatch_argv.index("--", start)]


def test_a_secret_reaches_the_batch_job_in_sbatchs_environment_never_its_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`ps` and `scontrol show job` show sbatch's command line to every user; the batch script's `up --env HF_TOKEN`
    reads the value from the environment sbatch passes on (--export=ALL)."""
    secret = "hf_s3cr3t-value"
    argv, token = submitted(tmp_path, monkeypatch, "--job", "j", "--env", f"HF_TOKEN={secret}", "--env=MODE=fast",
                            "--", "--epochs", "1")
    assert token == secret and not [a for a in argv if secret in a]
    assert "--export=ALL" in argv and up_args(argv) == ["--job", "j", "--env", "HF_TOKEN", "--env=MODE=fast"]
    assert (tmp_path / "state" / "ddp-cifar" / "jobs" / "j.slurm").read_text() == "7\n"  # status/kill may ask Slurm
    assert capsys.readouterr().out == "7\n"
    assert cli.main(["submit", "--nodes", "2", "--job", "j", "--env", f"HF_TOKEN={secret}", "--entry", "/app/t.py",
                     "--dry-run", "--", "--note", secret]) == 0
    out = capsys.readouterr().out
    assert secret not in out and "--env HF_TOKEN --entry /app/t.py --" in out and "-- --note ****\n" in out
    assert "# in sbatch's environment, not its command line: HF_TOKEN\n" in out
    monkeypatch.setenv("HF_TOKEN", secret)  # the batch script's `up`, in the environment sbatch passed on
    _, config = cli.parse_args(["up", "--hosts", str(tmp_path / "hosts"), "--env", "HF_TOKEN", "--env", "A=1"])
    assert isinstance(config, UpConfig) and config.program.env == (("HF_TOKEN", secret), ("A", "1"))


def test_submit_takes_no_abbreviation_and_passes_ups_options_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--gpus` was read as an abbreviation of --gpus-per-node: both values vanished."""
    argv, _ = submitted(tmp_path, monkeypatch, "--gpus-per-node", "8", "--gpus", "0")
    assert "--gpus-per-node=8" in argv and up_args(argv) == ["--gpus", "0"]
    (tmp_path / "all").mkdir()
    argv, _ = submitted(tmp_path / "all", monkeypatch, "--gpus", "all")
    assert up_args(argv) == ["--gpus", "all"] and not [a for a in argv if a.startswith("--gpus-per-node")]
    assert cli.main(["submit", "--nodes", "2", "--gpus-per", "8", "--dry-run"]) == 2
    assert "error: unrecognized arguments: --gpus-per " in capsys.readouterr().err


def test_the_batch_scripts_stop_reaches_the_nodes_as_its_up_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch.sh run for real (bash) with stand-in srun, squeue and Python: at Slurm's SIGTERM its `kill` gets the
    ssh config and host-key option `up` got (without them, with a home that is not shared, the stop could not reach
    the nodes and the guards SIGKILLed the containers with no checkpoint), and `up` reads the secret from the
    environment sbatch passed on."""
    import signal
    import subprocess
    import time

    from orchestrate.backends.slurm import submit

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "$SLURM_JOB_ID.0"\n')
    # Logs its HF_TOKEN and then its arguments by subcommand (the arguments' file, written last, is the gate the
    # test waits on); `up` runs until signalled.
    python = bin_dir / "python"
    python.write_text(f'#!/bin/bash\nprintf "%s" "${{HF_TOKEN:-unset}}" > {log}/$3.token\n'
                      f'printf "%s\\0" "$@" > {log}/$3.part && mv {log}/$3.part {log}/$3\n'
                      '[ "$3" = up ] && exec sleep 60\nexit 0\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (tmp_path / "ssh_config").write_text("")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    sub, _ = submit.submission(["--nodes", "2", "--job", "j", "--python", str(python), "--ssh-config",
                                str(tmp_path / "ssh_config"), "--accept-new-host-keys", "--env", "HF_TOKEN=s3cr3t"],
                               ["--epochs", "1"], cli.COMMAND_LINE)
    argv = script.sbatch_argv(sub)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "9", **dict(sub.secret_env)}
    batch = subprocess.Popen(["bash", *argv[argv.index(str(script.BATCH_SCRIPT)):]], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (log / "up").exists() and batch.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    batch.send_signal(signal.SIGTERM)  # Slurm's, at scancel or ahead of the time limit
    assert batch.wait(timeout=30) == 143
    connect = ["--ssh-config", str(tmp_path / "ssh_config"), "--accept-new-host-keys"]
    assert (log / "kill").read_text().split("\0")[:-1] == ["-m", "orchestrate", "kill", "--hosts", "slurm", "--job", "j",
                                                           "--grace", "20", *connect]
    up = (log / "up").read_text().split("\0")[:-1]
    assert up[:4] == ["-m", "orchestrate", "up", "--hosts"] and up[-3:] == ["--", "--epochs", "1"]
    assert all(arg in up for arg in connect) and "HF_TOKEN" in up and "s3cr3t" not in "".join(up)
    assert (log / "up.token").read_text() == "s3cr3t"


def test_submit_of_a_job_file_takes_its_name_ssh_config_and_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`submit -f job.toml`: the file's job name is sbatch's, its ssh config reaches the stop's `kill`, and its args
    the batch script's `up` (which gets `--`: the file's args would otherwise be replaced by none). Its `hosts =`
    is left to the allocation."""
    fake_slurm(tmp_path, monkeypatch)
    (tmp_path / "ssh_config").write_text("")
    (tmp_path / "job.toml").write_text('job = "fromfile"\nhosts = "hosts.txt"\nssh_config = "ssh_config"\n'
                                       'args = ["--epochs", "2"]\n')
    assert cli.main(["submit", "--nodes", "2", "-f", str(tmp_path / "job.toml"), "--dry-run"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sbatch "))
    assert "--job-name=fromfile " in command
    assert command.endswith(f'" 2 --ssh-config {tmp_path / "ssh_config"} -f {tmp_path / "job.toml"} -- --epochs 2')
