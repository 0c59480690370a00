"""The example programs (examples/) run locally under torchrun, 2 ranks on gloo, without containers: they end
with exit 0 and their last line, and no rank goes through the interpreter's finalization (where gloo's threads
aborted a rank after DONE: examples/example_ckpt.py exit_without_finalizing). Needs torch with gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "finalize_probe"  # its sitecustomize marks the ranks that finalize
# name → (torchrun's entry, arguments, a folder for PYTHONPATH)
EXAMPLES = {
    "minimal": (["examples/minimal/train.py"], ["--steps", "3"], "examples"),
    "charlm": (["-m", "charlm.train"], ["--steps", "3", "--text", "input.txt", "--context", "4"], "examples/charlm"),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_ends_with_its_last_line_and_no_rank_finalizes(name: str, tmp_path: Path) -> None:
    entry, args, path = EXAMPLES[name]
    for sub in ("data", "ckpt", "logs", "probe"):
        (tmp_path / sub).mkdir()
    (tmp_path / "data" / "input.txt").write_text("to be or not to be, that is the question. " * 40)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DATA_DIR": str(tmp_path / "data"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "LOG_DIR": str(tmp_path / "logs"), "PROBE_DIR": str(tmp_path / "probe"),
           "PYTHONPATH": os.pathsep.join([str(PROBE), str(REPO / path), str(REPO / "examples")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(_port()), *entry, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("DONE step=3"), proc.stdout[-1000:]
    assert sorted(p.name for p in (tmp_path / "probe").glob("finalized-*")) == []


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
