"""What a person sees of every rank (issue 35): the straggler on the progress line and in `status`, one line per
node, the last run's progress labelled as such, each node's GPU use from nvidia-smi, and the preflight table in
100 columns. Pure parts, no hosts (the cluster test is tests/cluster/test_see_every_rank.py)."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console

from orchestrate.backends.docker_ssh.gpuusage import GpuUse, index_ranges, parse_usage, read_usage, usage_text
from orchestrate.backends.docker_ssh.jobview import ended_line, running_lines
from orchestrate.probe.heartbeat import Beat
from orchestrate.probe.observations import Check, HostReport
from orchestrate.probe.preflight import COLUMNS, render_table
from orchestrate.watch.progress import ProgressView
from trainer.straggler import STRAGGLER_WINDOWS, streaks

HOSTS = {0: "gpu-a", 1: "gpu-b", 2: "gpu-c"}


def beat(work: list[float], step: int = 40, per: int = 2, windows: int = STRAGGLER_WINDOWS) -> Beat:
    """A heartbeat of 3 nodes x `per` ranks with these own-work times (seconds per step), as the trainer writes it
    after `windows` agreement windows of them."""
    streak: tuple[int, ...] | None = None
    for _ in range(windows):
        streak = streaks(streak, work)
    parsed = Beat.parse(json.dumps({
        "step": step, "total_steps": 100, "epoch": 1, "epochs": 2, "loss": 1.5, "images_per_s": 300.0,
        "rank_step_s": [0.2] * len(work), "rank_work_s": work, "rank_data_s": [0.001] * len(work),
        "ranks_per_node": per, "rank_streak": streak}))
    assert parsed is not None
    return parsed


EVEN = [0.05, 0.051, 0.049, 0.05, 0.052, 0.05]
NODE2_SLOW = [0.05, 0.051, 0.049, 0.05, 0.15, 0.05]  # rank 4 (node 2) at 3x the median


def test_status_names_the_slowest_node_and_rank_only_when_clearly_slower() -> None:
    slow = running_lines(beat(NODE2_SLOW), HOSTS, {})
    assert slow[:2] == ["progress: step 40/100 (40%) epoch 1/2 loss 1.500 300 img/s",
                        "slowest: node 2 rank 4, 3.0x the median step"]
    assert not any("slowest" in line for line in running_lines(beat(EVEN), HOSTS, {}))
    # Slower in fewer windows in a row than it takes: not yet.
    assert not any("slowest" in line for line in running_lines(beat(NODE2_SLOW, windows=2), HOSTS, {}))
    assert not any("slowest" in line for line in running_lines(beat([0.05, 0.06, 0.05, 0.05, 0.062, 0.05]), HOSTS, {}))


def test_status_has_one_line_per_node_within_100_columns() -> None:
    lines = running_lines(beat(NODE2_SLOW), HOSTS, {1: "GPU 0-7 91-98% busy, 561/637 GiB"})[2:]
    assert lines == [
        "node 0 gpu-a: step 0.2 s, work 0.051 s (1.0x), data 0.001 s",
        "node 1 gpu-b: step 0.2 s, work 0.05 s (1.0x), data 0.001 s | GPU 0-7 91-98% busy, 561/637 GiB",
        "node 2 gpu-c: step 0.2 s, work 0.15 s (2.9x), data 0.001 s"]
    long = running_lines(beat(EVEN), {0: "x" * 120, 1: "b", 2: "c"}, {})[1:]
    assert len(long) == 3 and all(len(line) <= 100 for line in long) and long[0].endswith("…")
    # Another program's heartbeat (no per-rank timings): the GPUs alone; a CPU job of it: no node lines.
    other = Beat.parse('{"step": 7}')
    assert running_lines(other, HOSTS, {0: "GPU 0 5% busy, 1/80 GiB"})[1:] == [
        "node 0 gpu-a: GPU 0 5% busy, 1/80 GiB"]
    assert running_lines(other, HOSTS, {}) == ["progress: step 7"]
    assert running_lines(None, HOSTS, {}) == []


def test_a_finished_jobs_progress_is_labelled_the_last_runs_with_when_it_ended() -> None:
    done = Beat.parse('{"step": 62, "total_steps": 62, "epoch": 2, "epochs": 2, "state": "done"}')
    assert done is not None
    ended = 1764068533.0  # 2025-11-25 11:02:13 UTC
    assert ended_line(done, ended, ended + 250) == \
        "last run, ended 2025-11-25 11:02:13 UTC (0h04m10s ago): step 62/62 (100%) epoch 2/2 done"
    assert ended_line(done, None, ended).startswith("last run (ended): step 62/62")


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_progress_line_names_the_straggler_at_once_and_drops_it_at_once(monkeypatch) -> None:
    """Without a terminal a line is printed every 30 s, and at once when the straggler named changes."""
    import orchestrate.watch.progress as progress

    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    out = io.StringIO()
    view = ProgressView(Console(file=out, width=200))

    def show(work: list[float], step: int) -> None:
        clock.now += 2  # a new beat, well within 30 s of the last line
        view.show(beat(work, step))

    show(EVEN, 10)  # the first line
    show(EVEN, 11)  # nothing new to say
    show(NODE2_SLOW, 12)  # named at once
    show([0.05, 0.051, 0.049, 0.05, 0.16, 0.05], 13)  # the same rank, another score: no new line
    show(EVEN, 14)  # gone: said at once
    lines = out.getvalue().splitlines()
    assert [re.sub(r" epoch.*?img/s", "", line) for line in lines] == [
        "progress: step 10/100 (10%)",
        "progress: step 12/100 (12%); slowest: node 2 rank 4, 3.0x the median step",
        "progress: step 14/100 (14%)"]


# `nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits` on an
# 8-GPU H100 node, in the format nvidia-smi documents (--help-query-gpu): no GPU ran here to record it.
SMI_NOUNITS = """\
0, 97, 71234, 81559
1, 98, 71230, 81559
2, 91, 70102, 81559
3, 96, 71001, 81559
4, 0, 4, 81559
5, 0, 4, 81559
6, 0, 4, 81559
7, 0, 4, 81559
"""


def test_gpu_use_is_read_from_nvidia_smi_for_the_gpus_the_job_holds() -> None:
    rows = parse_usage(SMI_NOUNITS)
    assert len(rows) == 8 and rows[2] == GpuUse(2, 91, 70102, 81559)
    assert usage_text(rows, (0, 1, 2, 3)) == "GPU 0-3 91-98% busy, 277/319 GiB"
    assert usage_text(rows, (4,)) == "GPU 4 0% busy, 0/80 GiB"
    assert usage_text(rows, ()) is None and usage_text(rows, (9,)) is None
    # Units left in (devcluster's simulated nvidia-smi, an older driver) and [N/A] (MIG, vGPU); noise lines.
    odd = parse_usage("0, [N/A], 1024 MiB, 81559 MiB\nFailed to initialize NVML: Unknown Error\n1, 50 %, 0 MiB, 81559 MiB")
    assert odd == [GpuUse(0, None, 1024, 81559), GpuUse(1, 50, 0, 81559)]
    assert usage_text(odd, (0,)) == "GPU 0 ? busy, 1/80 GiB"
    assert index_ranges([6, 0, 1, 2, 3]) == "0-3,6" and index_ranges([1, 3]) == "1,3"


def test_a_cpu_node_is_never_asked_about_gpus() -> None:
    assert read_usage(object(), ()) is None  # type: ignore[arg-type]  # no connection is touched


def test_the_preflight_table_fits_100_columns_and_wraps_between_words() -> None:
    """The table had a column per check (about 170 columns wide): squeezed into 100 columns, rich cut words
    apart. Now what is not fine comes first and in full, the rest folded into one paragraph."""
    texts = {"ssh": "ddp@10.30.0.11", "docker": "20.10.24+dfsg1", "gpus": "CPU mode",
             "disk": "data 40.1 GB free, ckpt 40.1 GB free, log 40.1 GB free", "port": "29500 free",
             "master": "10.30.0.11 is local", "iface": "eth0", "net": "sockets (gloo)", "image": "will be sent",
             "job": "free"}
    refused = "ckpt dir /home/ddp/ck not writable (/home/ddp); choose another dir or fix permissions"
    reports = []
    for i in range(3):
        reports.append(HostReport(f"dc-demo-h{i}", {col: Check(True, texts[col]) for col in COLUMNS}))
    reports[1] = HostReport("dc-demo-h1", {**reports[1].checks, "disk": Check(False, refused)})
    for width in (100, 72):
        out = io.StringIO()
        Console(file=out, width=width).print(render_table(reports))
        lines = out.getvalue().splitlines()
        assert max(len(line) for line in lines) <= width
        shown = {word.rstrip(";") for word in out.getvalue().split()}  # "; " between checks
        for text in [*texts.values(), refused]:  # every word of every check whole: none cut across lines
            assert all(word.rstrip(";") in shown for word in text.split()), (text, out.getvalue())
        refused_at = next(i for i, line in enumerate(lines) if "disk: ckpt dir" in line)
        assert "dc-demo-h1" in lines[refused_at]  # the refusal is the first thing said about its host


def test_the_event_file_listing_never_leads_out_of_the_local_folder() -> None:
    from orchestrate.backends.docker_ssh.hostfiles import listing
    from orchestrate.jobs.tensorboard import within

    text = ("1234 ./tensorboard/events.out.tfevents.1764068533.vm.7.0\n"
            "88 ./my run/events.out.tfevents.2\n"
            "5 ../../etc/events.out.tfevents.3\n"
            "6 /etc/events.out.tfevents.4\n"
            "stat: cannot stat 'x': No such file\n")
    assert within(listing(text)) == [("tensorboard/events.out.tfevents.1764068533.vm.7.0", 1234),
                                     ("my run/events.out.tfevents.2", 88)]
