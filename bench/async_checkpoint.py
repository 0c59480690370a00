"""How long training pauses for a checkpoint: synchronous against asynchronous (--ckpt-async), in one run.

    .venv/bin/python bench/async_checkpoint.py [--model resnet18] [--batch 32] [--saves 3] [--device cuda]

One process (on CPU by default), one thread, the trainer's own save (trainer.loop.save) of its real training state after a step
(model, SGD momentum, scaler, RNG, config). For each mode, `--saves` times:
- sync: the save call returns once the .pt and its manifest are written, fsynced and hashed (the pause);
- async: the save call returns once the state is copied off the device (the pause); then training steps run while
  the background thread writes, fsyncs and hashes it, and the next save (here: finish_pending_save) waits for it.
Printed: the state's size, the median pause of each, the background write's time, and the step time alone and
while the write runs (on a GPU the write competes for a CPU core only; here, with one core, for the step itself).
Exits 1 when the asynchronous pause is more than MAX_PAUSE_RATIO of the synchronous one (bench/bounds.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

from trainer import checkpoint, defaults, dist, loop, metrics, saving, state, strategies  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.pace import Pace  # noqa: E402

torch.set_num_threads(1)
MAX_OVERLAP_STEPS = 200  # a bound: a write takes a few steps' time
MAX_PAUSE_RATIO = 0.5  # docs/gpu-nodes.md: the asynchronous save pauses training far less than the synchronous one


class _Loader:
    """What loop.save reads of the loader."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch


def _step(st: state.TrainState, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loop.train_step(st, x, y, 0.1, "fp32").item()
    return time.perf_counter() - t0


def _measure(ns: argparse.Namespace, folder: Path, asynchronous: bool) -> dict[str, list[float]]:
    cfg = Config(data_dir=folder, ckpt_dir=folder, model=ns.model, keep_checkpoints=2, device=ns.device,
                 ckpt_async="on" if asynchronous else "off")
    ctx = dist.DistContext(0, 0, 1, torch.device(ns.device))
    checkpoint.check_writable(folder)  # creates it, as the trainer's start does
    st = state.build(cfg, ctx)
    x, y = torch.randn(ns.batch, 3, 32, 32, device=ctx.device), torch.randint(0, 10, (ns.batch,), device=ctx.device)
    # The settings as for this device, except the mode under test (fp32 on a GPU too: the same state as on CPU).
    pace = Pace(metrics.Heartbeat(folder, False, 0, 1, ns.batch),
                     defaults.resolve(cfg, ctx.device.type, False, ns.batch), strategies.for_config(cfg))
    out: dict[str, list[float]] = {"pause": [], "write": [], "step_alone": [], "step_during_write": []}
    _step(st, x, y)  # the optimizer's momentum exists after the first step: the state a run saves
    for _ in range(ns.saves):
        out["step_alone"].append(_step(st, x, y))
        st.pos.step += 1
        t0 = time.perf_counter()
        saving.save(cfg, ctx, st, _Loader(ns.batch), pace, background=asynchronous)  # type: ignore[arg-type]
        out["pause"].append(time.perf_counter() - t0)
        if asynchronous:
            for _ in range(MAX_OVERLAP_STEPS):
                if not pace.writer.writing:
                    break
                out["step_during_write"].append(_step(st, x, y))
            saving.finish_pending_save(cfg, ctx, pace)
            out["write"].append(pace.writer.write_s)
    return out


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.1f} ms" if values else "       -   "


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-async-ckpt-") as tmp:
        sync = _measure(ns, Path(tmp) / "sync", asynchronous=False)
        asyn = _measure(ns, Path(tmp) / "async", asynchronous=True)
        size = max(p.stat().st_size for p in (Path(tmp) / "sync").glob("ckpt-*.pt"))
    print(f"{ns.model}, checkpoint of {size / 1e6:.1f} MB (model + SGD momentum + trainer state), {ns.device}, "
          f"1 thread, median of {ns.saves} saves")
    print(f"  training paused, synchronous save   {_ms(sync['pause'])}  (write + fsync + sha256 + manifest)")
    print(f"  training paused, asynchronous save  {_ms(asyn['pause'])}  (copy off the device)")
    print(f"  background write (its own thread)   {_ms(asyn['write'])}  (training went on meanwhile)")
    print(f"  step (batch {ns.batch}) alone           {_ms(sync['step_alone'] + asyn['step_alone'])}")
    print(f"  step while the write runs           {_ms(asyn['step_during_write'])}  "
          f"({len(asyn['step_during_write'])} steps overlapped the writes)")
    paused = statistics.median(asyn["pause"]), statistics.median(sync["pause"])
    return finish([Figure("training paused, asynchronous / synchronous save", paused[0] / paused[1], "x",
                          f"synchronous {paused[1] * 1000:.0f} ms (asynchronous {paused[0] * 1000:.0f} ms)",
                          MAX_PAUSE_RATIO, False)])


if __name__ == "__main__":
    sys.exit(main())
