"""Input pipeline benchmark: the classic torchvision/PIL/DataLoader pipeline against the trainer's batched one.

Same synthetic data (official file layout), same augmentation (random crop 32 with padding 4, horizontal
flip, normalise), same batch size, same number of threads; both run in this one process, one after the other.

    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    .venv-bench/bin/python bench/input_pipeline.py [--images 20000] [--threads 1] [--workers 0]

This is a benchmark, not a test: it prints images/s of both pipelines, per core, and their ratio; it exits 1
when ours is less than GOAL_PER_CORE times the classic one per core (bench/bounds.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repo holds trainer/
from bounds import Figure, finish  # noqa: E402

from trainer import data  # noqa: E402

GOAL_PER_CORE = 10.0  # the goal: at least 10x the classic pipeline's images/s per core

VENV_HINT = (
    "torchvision is not installed in this interpreter. Make the benchmark venv (local wheels, ~1 min, 5.5 GB):\n"
    "  python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy\n"
    "then run: .venv-bench/bin/python bench/input_pipeline.py"
)


def classic_loader(root: Path, batch: int, workers: int) -> Iterable:
    """The tutorial pipeline: torchvision CIFAR10 + per-image PIL transforms through a DataLoader."""
    import torchvision
    import torchvision.transforms as T

    folder = root / data.BASE_FOLDER

    class SyntheticCIFAR10(torchvision.datasets.CIFAR10):
        # torchvision verifies the official md5s; check the synthetic files' own md5s instead.
        train_list = [[name, data.md5_of(folder / name)] for name, _ in data.TRAIN_FILES]
        test_list = [[name, data.md5_of(folder / name)] for name, _ in data.TEST_FILES]
        meta = {"filename": "batches.meta", "key": "label_names", "md5": data.md5_of(folder / "batches.meta")}

    transform = T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(data.MEAN, data.STD),
    ])
    ds = SyntheticCIFAR10(str(root), train=True, transform=transform, download=False)
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)


def batched_loader(root: Path, batch: int) -> Iterable:
    """The trainer's pipeline: uint8 tensor in memory, seeded permutation, crop+flip+normalise per batch."""
    train, _ = data.load_cifar(root, allow_unverified=True)
    return data.TrainLoader(train, batch, rank=0, world=1, seed=0).batches(epoch=0)


def images_per_s(batches: Iterable) -> tuple[float, int]:
    n, t0 = 0, time.perf_counter()
    for x, _ in batches:
        n += x.shape[0]
    return n / (time.perf_counter() - t0), n


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=20000, help="training images in the synthetic set")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both pipelines")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes for the classic one")
    args = p.parse_args()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.stderr.write(VENV_HINT + "\n")
        return 2
    torch.set_num_threads(args.threads)
    logging.getLogger("trainer").setLevel(logging.ERROR)  # the synthetic set is "unverified" by design
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data.write_synthetic(root, args.images, 10)
        classic, n_classic = images_per_s(classic_loader(root, args.batch_size, args.workers))
        ours, n_ours = images_per_s(batched_loader(root, args.batch_size))
    classic_cores = max(args.workers, args.threads)  # workers do the work; the main process mostly waits
    ours_cores = args.threads
    print(f"torch {torch.__version__}, {args.images} synthetic images, batch {args.batch_size}, "
          f"threads {args.threads}, classic workers {args.workers}")
    print(f"classic (torchvision + PIL + DataLoader): {classic:10.0f} images/s  "
          f"{classic / classic_cores:10.0f} per core ({n_classic} images, {classic_cores} core(s))")
    print(f"batched (trainer.data, tensor ops)      : {ours:10.0f} images/s  "
          f"{ours / ours_cores:10.0f} per core ({n_ours} images, {ours_cores} core(s))")
    per_core = (ours / ours_cores) / (classic / classic_cores)
    print(f"ratio: {ours / classic:.1f}x images/s, {per_core:.1f}x per core")
    return finish([Figure("batched pipeline, images/s per core against the classic one", per_core, "x",
                          f"classic {classic / classic_cores:.0f} images/s per core (ours {ours / ours_cores:.0f})",
                          GOAL_PER_CORE, True)])


if __name__ == "__main__":
    raise SystemExit(main())
