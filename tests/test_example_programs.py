"""The example programs (examples/) run locally under torchrun, 2 ranks on gloo, without containers: they end
with exit 0 and their last line, and no rank goes through the interpreter's finalization (where gloo's threads
aborted a rank after DONE: examples/example_ckpt.py exit_without_finalizing). Needs torch with gloo."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kit.net import free_port
from kit.waits import wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "finalize_probe"  # its sitecustomize marks the ranks that finalize
# name → (torchrun's entry, arguments, a folder for PYTHONPATH)
EXAMPLES = {
    "minimal": (["examples/minimal/train.py"], ["--steps", "3"], "examples"),
    "charlm": (["-m", "charlm.train"], ["--steps", "3", "--text", "input.txt", "--context", "4"], "examples/charlm"),
}


TEXT = "to be or not to be, that is the question. " * 40


def _env(tmp_path: Path, ckpt: Path, **extra: str) -> dict[str, str]:
    """DATA_DIR with a small text, CKPT_DIR, LOG_DIR and PROBE_DIR under tmp_path; loopback for gloo; CUDA hidden, so
    that the examples take their gloo path on a GPU machine too (2 or 4 ranks would need as many GPUs)."""
    for sub in ("data", "logs", "probe"):
        (tmp_path / sub).mkdir(exist_ok=True)
    ckpt.mkdir(exist_ok=True)
    (tmp_path / "data" / "input.txt").write_text(TEXT)
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DATA_DIR": str(tmp_path / "data"),
            "CKPT_DIR": str(ckpt), "LOG_DIR": str(tmp_path / "logs"), "PROBE_DIR": str(tmp_path / "probe"),
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(PROBE), str(REPO / "examples/charlm"), str(REPO / "examples")]),
            **extra}


def _torchrun(nproc: int, entry: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *entry, *args]


# Every rank prints its own lines into one stream; two may interleave within a line, so numbers are found by pattern.
LOSS_RE = re.compile(r"step (\d+) loss (\d+\.\d{4})")
DONE_RE = re.compile(r"DONE step=(\d+) loss=(\d+\.\d{4})")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_ends_with_its_last_line_and_no_rank_finalizes(name: str, tmp_path: Path) -> None:
    entry, args, path = EXAMPLES[name]
    env = _env(tmp_path, tmp_path / "ckpt", PYTHONPATH=os.pathsep.join([str(PROBE), str(REPO / path),
                                                                         str(REPO / "examples")]))
    proc = subprocess.run(_torchrun(2, entry, args), cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Nothing after rank 0's DONE line. Not "the last line starts with DONE": the ranks share one stream, and rank
    # 1's last step line may be cut by it (CI saw `step 3 loss 13.9310DONE step=3 ...`, its newline after).
    done = list(DONE_RE.finditer(proc.stdout))
    assert done and done[-1].group(1) == "3" and not proc.stdout[done[-1].end():].strip(), proc.stdout[-1000:]
    assert sorted(p.name for p in (tmp_path / "probe").glob("finalized-*")) == []


CHARLM = ["-m", "charlm.train"]
CHARLM_ARGS = ["--text", "input.txt", "--context", "4", "--log-every", "1"]


def _losses(stdout: str) -> dict[int, list[float]]:
    """The distinct losses printed at each step, sorted: one per dp rank (tp peers print the same)."""
    out: dict[int, set[float]] = {}
    for step, loss in LOSS_RE.findall(stdout):
        out.setdefault(int(step), set()).add(float(loss))
    return {step: sorted(found) for step, found in out.items()}


def _stop_after(cmd: list[str], env: dict[str, str], out: Path, line: str) -> None:
    """Start cmd, wait (bounded) until `line` is in its output, SIGTERM it (torchrun passes it on) and reap it."""
    with out.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: line in out.read_text() or proc.poll() is not None, 120, repr(line), every=0.2)
        assert line in out.read_text(), out.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_charlm_tp_shards_its_mlp_stops_with_a_checkpoint_and_resumes_in_another_layout(tmp_path: Path) -> None:
    """--tp 2 on 4 processes (dp=2 x tp=2, gloo): the MLP's linears are DTensors sharded on the tp dim (column-wise,
    row-wise) and over dp by FSDP; tp peers train on the same windows (one loss per dp rank); the loss falls; SIGTERM
    checkpoints (the full state, with its manifest) and stops. The checkpoint resumes at dp=1 x tp=2 and as plain DDP
    on 1 process to the same losses: the whole model and Adam state came back, in either layout."""
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "tp.out"
    _stop_after(_torchrun(4, CHARLM, [*CHARLM_ARGS, "--tp", "2", "--steps", "1000", "--step-seconds", "0.2"]),
                _env(tmp_path, ckpt), out, "step 4 loss")
    text = out.read_text()
    (layout_line,) = [ln for ln in text.splitlines() if ln.startswith("LAYOUT ")]
    layout = json.loads(layout_line.split(" ", 1)[1])
    colwise, rowwise = layout["mlp.1.weight"], layout["mlp.3.weight"]
    assert colwise["mesh"] == rowwise["mesh"] == ["dp", "tp"]
    assert colwise["placements"][1] == "Shard(dim=0)" and rowwise["placements"][1] == "Shard(dim=1)"  # tp dim
    # FSDP over dp, dim 0 (on a dim TP sharded already it is a _StridedShard: the tp chunks stay in order)
    assert "Shard(dim=0" in colwise["placements"][0] and rowwise["placements"][0] == "Shard(dim=0)"
    assert colwise["local"] == [colwise["global"][0] // 4, colwise["global"][1]]  # 128 rows over 2 x 2
    assert rowwise["local"][1] == rowwise["global"][1] // 2  # the hidden units over tp
    losses = _losses(text)
    assert all(len(found) == 2 for found in losses.values()), losses  # 4 ranks, 2 dp ranks' windows
    assert max(losses[4]) < min(losses[1]) * 0.8, losses
    (manifest,) = [json.loads(p.read_text()) for p in ckpt.glob("ckpt-*.json")]
    stopped = int(manifest["step"])
    assert manifest["epoch_complete"] is False and manifest["world_size"] == 4 and stopped >= 4
    assert f"stopped at step {stopped} after a checkpoint" in text

    runs = {}
    for name, nproc, extra in (("tp", 2, ["--tp", "2"]), ("ddp", 1, [])):
        folder = tmp_path / f"ckpt-{name}"
        shutil.copytree(ckpt, folder)
        res = subprocess.run(_torchrun(nproc, CHARLM, [*CHARLM_ARGS, *extra, "--steps", str(stopped + 3)]), cwd=REPO,
                             env=_env(tmp_path, folder, RESUME="1"), capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"resumed at step {stopped}" in res.stdout and f"DONE step={stopped + 3}" in res.stdout, res.stdout
        runs[name] = res.stdout
    tp, ddp = _losses(runs["tp"]), _losses(runs["ddp"])
    assert sorted(tp) == [stopped + 1, stopped + 2, stopped + 3]
    for step in tp:  # one dp rank in both: the same windows, the same state, the same loss
        assert tp[step] == pytest.approx(ddp[step], abs=2e-4), (tp, ddp)
    assert DONE_RE.findall(runs["tp"]) == DONE_RE.findall(runs["ddp"])
    assert float(DONE_RE.findall(runs["tp"])[0][1]) < min(losses[4])


def _charlm_alone(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """charlm as one process without torchrun (rank 0 of 1, or WORLD_SIZE as given)."""
    base = _env(tmp_path, tmp_path / "ckpt", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, *CHARLM, *CHARLM_ARGS, *args], cwd=REPO, env=base | env,
                          capture_output=True, text=True, timeout=120)


def test_charlm_refuses_a_tp_that_does_not_divide_the_processes(tmp_path: Path) -> None:
    res = _charlm_alone(tmp_path, ["--tp", "3"], WORLD_SIZE="4")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: --tp 3 does not divide the 4 processes (WORLD_SIZE); give a divisor of it"]


def test_charlm_refuses_a_checkpoint_from_before_tp_with_one_line(tmp_path: Path) -> None:
    """torch's own optimizer state_dict (keyed by index, as charlm wrote before --tp) is refused, not a KeyError."""
    sys.path[:0] = [str(REPO / "examples"), str(REPO / "examples/charlm")]
    import example_ckpt
    import torch
    from charlm.train import CharModel

    vocab = sorted(set(TEXT))
    model = CharModel(len(vocab), 4)  # what charlm wrote then: the module's and Adam's own state_dict, one step in
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    old = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3, "vocab": vocab}
    example_ckpt.save(str(tmp_path / "ckpt"), old, 3, epoch=0, epoch_complete=False, world_size=1)
    res = _charlm_alone(tmp_path, ["--steps", "6"], RESUME="1")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == ("error: the checkpoint is from charlm before --tp (optimizer state "
                                                   "by index, not by name); start without --resume")


@pytest.mark.parametrize("cuda", [True, False])
def test_the_examples_put_everything_on_their_own_gpu_when_there_is_one(cuda: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a GPU shows the tensors landing there; the decision (device, backend, set_device first) is here."""
    sys.path.insert(0, str(REPO / "examples"))
    import example_ckpt
    import torch

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: calls.append(("init", (backend, kw.get("device_id")))))
    monkeypatch.setenv("LOCAL_RANK", "3")
    device = example_ckpt.join_group()
    gpu = torch.device("cuda", 3)
    assert (device, calls) == ((gpu, [("set_device", gpu), ("init", ("nccl", gpu))]) if cuda else
                               (torch.device("cpu"), [("init", ("gloo", None))]))
    for program in ("minimal/train.py", "charlm/charlm/train.py"):  # both take their device from it
        text = (REPO / "examples" / program).read_text()
        assert "device = join_group()" in text and "init_process_group" not in text
