"""trainer/launch.py, the start of one process a node without torchrun's agent: real launcher processes on loopback.

What the orchestrator and the program rely on (docs/DESIGN.md §7): torchrun's worker environment, with rank 0's
process group hosting the store (there is no agent's); torchrun's per-rank files and `[default0]:` console lines
(`logs --rank` reads both); the program's exit code; a SIGTERM reaching the program (docker stop's checkpoint)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kit.lines import LineReader

REPO = Path(__file__).resolve().parents[2]
ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("rank", os.environ["RANK"], "local", os.environ["LOCAL_RANK"], "of", dist.get_world_size(), "sum", int(t.item()))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(node_rank: int, nnodes: int, port: int, log_dir: Path, program: Path, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "trainer.launch", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "--nproc_per_node", "1",
            "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3", str(program), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(argv, cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def rank_files(log_dir: Path) -> dict[str, str]:
    [run] = list(log_dir.iterdir())  # one run folder, named as torchrun names its own: <run id>_<random>
    assert run.name.startswith("none_")
    folder = run / "attempt_0" / "0"
    return {f.name: f.read_text() for f in folder.iterdir()}


def test_two_nodes_of_one_process_join_with_rank_0_hosting_the_store(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(ALL_REDUCE)
    port = free_port()
    nodes = [launch(r, 2, port, tmp_path / f"logs{r}", program) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in nodes]
    finally:  # a launcher that hung: its program too (a container's end takes both)
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in nodes] == [0, 0], outs
    for r, (out, _) in enumerate(outs):
        assert f"[default0]:rank {r} local 0 of 2 sum 3\n" in out  # torchrun's console prefix
        assert rank_files(tmp_path / f"logs{r}")["stdout.log"] == f"rank {r} local 0 of 2 sum 3\n"


def test_the_programs_environment_its_files_and_its_exit_code(tmp_path: Path) -> None:
    program = tmp_path / "env.py"
    program.write_text(textwrap.dedent("""
        import os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"]
        print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
        print(os.environ["TORCHELASTIC_ERROR_FILE"].endswith("/attempt_0/0/error.json"), sys.argv[1:])
        print("half a line", end="", file=sys.stderr)
        sys.exit(7)
    """))
    proc = launch(2, 3, 29999, tmp_path / "logs", program, "--epochs", "1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7  # the program's code, not torchrun's 1
    assert out.splitlines() == [
        "[default0]:RANK=2 LOCAL_RANK=0 WORLD_SIZE=3 LOCAL_WORLD_SIZE=1 GROUP_RANK=2 MASTER_ADDR=127.0.0.1 "
        "MASTER_PORT=29999 TORCHELASTIC_RUN_ID=none TORCHELASTIC_USE_AGENT_STORE=None",
        "[default0]:True ['--epochs', '1']"]
    assert err == "[default0]:half a line\n"
    files = rank_files(tmp_path / "logs")
    assert files["stderr.log"] == "half a line" and files["stdout.log"].startswith("RANK=2 ")


def test_sigterm_reaches_the_program_and_its_code_is_the_launchers(tmp_path: Path) -> None:
    program = tmp_path / "term.py"
    program.write_text(textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("checkpoint saved", flush=True), sys.exit(143)))
        print("ready", flush=True)
        time.sleep(120)
    """))
    proc = launch(0, 1, 29998, tmp_path / "logs", program)
    lines = LineReader(proc.stdout)
    try:
        assert lines.next(60, "the program's first line") == "[default0]:ready\n"  # its handler is set
        proc.send_signal(signal.SIGTERM)
        assert lines.next(60, "the program's line on SIGTERM") == "[default0]:checkpoint saved\n"
        assert proc.wait(60) == 143 and lines.next(10, "the end of the output") == ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("args", "says"), [(("--nproc_per_node", "2"), "one process a node; use torchrun"),
                                            (("--node_rank", "3"), "--node_rank 3 is not in 0..1")])
def test_what_it_cannot_start_is_refused_with_exit_2(tmp_path: Path, args: tuple[str, str], says: str) -> None:
    argv = [sys.executable, "-m", "trainer.launch", "--nnodes", "2", "--node_rank", "0", "--master_addr", "h",
            "--master_port", "1", "--nproc_per_node", "1", "--log-dir", str(tmp_path), "x.py"]
    argv[argv.index(args[0]) + 1] = args[1]
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and says in done.stderr


def test_a_process_left_behind_holding_the_streams_does_not_keep_the_launcher(tmp_path: Path) -> None:
    """A loader's worker or any child the program leaves behind inherits its stdout: the launcher waits for the
    last lines at most DRAIN_S after the program's exit, then ends with the program's code (the container with it)."""
    program = tmp_path / "leave.py"
    program.write_text(textwrap.dedent("""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(90)"])  # inherits stdout and stderr
        print("done", flush=True)
    """))
    proc = launch(0, 1, 29996, tmp_path / "logs", program)
    try:
        out, _ = proc.communicate(timeout=45)  # DRAIN_S (10 s) and a margin; 90 s without the bound
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and out == "[default0]:done\n"
