"""CIFAR-10 on disk and in memory: archive reader with md5 check, synthetic writer, sharded batched loader.

The whole data set is held as one uint8 tensor on the training device; every step takes index slices of a
seeded permutation and does crop + flip + normalise on the whole batch with tensor ops (no per-image Python,
no DataLoader workers).  ``python -m trainer.data synth --out DIR`` writes a synthetic set in the official
layout.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import shutil
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import OneLineParser
from .contract import ALL_FILES, ARCHIVE_MD5, ARCHIVE_NAME, BASE_FOLDER, META_FILE, TEST_FILES, TRAIN_FILES
from .errors import DataError, TrainerError, shown

log = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4


# ---------------------------------------------------------------- reading the official layout


@dataclass(frozen=True)
class Split:
    """Images N x 3 x 32 x 32 uint8 and labels N int64, on one device."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> Split:
        return Split(self.images.to(device), self.labels.to(device))


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The batches are pickles: allow only what a numpy array needs, so a hostile file cannot run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"forbidden object {module}.{name}")
        return super().find_class(module, name)


def md5_of(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "md5").hexdigest()
    except OSError as e:
        raise DataError(f"cannot read {shown(path)} ({e.strerror or e}); check its permissions") from e


def _read_pickle(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise DataError(f"cannot read data file {shown(path)} ({e.strerror or e}); check its permissions") from e
    # What a damaged or hostile pickle raises while loading (an unknown codec is a LookupError, a huge
    # length an OverflowError or MemoryError): all mean the file is not a CIFAR batch.
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, LookupError,
            OverflowError, MemoryError) as e:
        raise DataError(f"data file {shown(path)} is corrupt ({e}); re-extract the archive or regenerate it") from e
    if not isinstance(raw, dict):
        raise DataError(f"data file {shown(path)} does not hold a CIFAR batch dict; re-extract the archive")
    # The official pickles come from Python 2 (keys load as bytes); ours from Python 3 (str keys).
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in raw.items()}


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    entry = _read_pickle(path)
    data, labels = entry.get("data"), entry.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"data file {shown(path)}: 'data' is not an N x 3072 uint8 array; re-extract the archive")
    wrong = DataError(f"data file {shown(path)}: 'labels' must be {data.shape[0]} integers in 0..9; re-extract the archive")
    try:
        found = np.asarray(labels)
    except (TypeError, ValueError):
        raise wrong from None
    # Integers only: strings ("3"), floats (2.7), bools and None would convert silently or not at all, and a
    # number beyond 64 bits makes an object array.
    if found.dtype.kind not in "iu" or found.shape != (data.shape[0],) or \
            (found.size and not 0 <= found.min() <= found.max() <= 9):
        raise wrong
    labels_arr = found.astype(np.int64)
    return data.reshape(-1, 3, 32, 32), labels_arr


def verify_files(folder: Path, allow_unverified: bool, warn: bool = True) -> None:
    """Every official file must exist; its md5 must match unless the user accepts unverified data. `warn`: say
    so when it does not (global rank 0 alone: once per job, not once per rank)."""
    for name, _ in ALL_FILES:
        try:
            present = (folder / name).is_file()
        except OSError as e:  # a folder this account may not enter (EACCES is not "missing")
            raise _unreachable(folder, e) from e
        if not present:
            raise DataError(
                f"data file {shown(folder / name)} is missing; extract the official {ARCHIVE_NAME} into {shown(folder.parent)} "
                f"or write a synthetic set with: python -m trainer.data synth --out {shown(folder.parent)}"
            )
    bad = [name for name, md5 in ALL_FILES if md5_of(folder / name) != md5]
    if bad and not allow_unverified:
        raise DataError(
            f"data files in {shown(folder)} do not match the official CIFAR-10 md5 ({', '.join(bad)}); re-download "
            f"the archive, or pass --allow-unverified-data for synthetic or your own data"
        )
    if bad and warn:
        log.warning("using unverified data in %s (md5 differs for %s)", folder, ", ".join(bad))


def _unreachable(folder: Path, err: OSError) -> DataError:
    return DataError(f"cannot read data folder {shown(folder)} ({err.strerror or err}); check the permissions of it "
                     "and of --data-dir")


def extract_archive(data_dir: Path, allow_unverified: bool) -> None:
    """Unpack <data-dir>/cifar-10-python.tar.gz if only the archive is there (call on one rank per node)."""
    folder, archive = data_dir / BASE_FOLDER, data_dir / ARCHIVE_NAME
    try:
        if folder.is_dir() or not archive.is_file():
            return
    except OSError as e:  # a --data-dir this account may not enter
        raise _unreachable(folder, e) from e
    if md5_of(archive) != ARCHIVE_MD5 and not allow_unverified:
        raise DataError(
            f"archive {shown(archive)} does not have the official md5 {ARCHIVE_MD5}; re-download it, "
            f"or pass --allow-unverified-data for synthetic or your own data"
        )
    tmp = data_dir / f".{BASE_FOLDER}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        with tarfile.open(archive, "r:gz") as tar:
            # Only the known members, copied by name: no path in the archive can escape the folder.
            for name, _ in ALL_FILES:
                member = tar.extractfile(f"{BASE_FOLDER}/{name}")
                if member is None:
                    raise DataError(f"archive {shown(archive)} has no {BASE_FOLDER}/{name}; re-download it")
                with (tmp / name).open("wb") as out:
                    shutil.copyfileobj(member, out)
        tmp.rename(folder)
    except (tarfile.TarError, KeyError, EOFError, OSError) as e:
        raise DataError(f"cannot extract {shown(archive)} into {shown(data_dir)}: {shown(e)}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("extracted %s", archive)


def load_cifar(data_dir: Path, allow_unverified: bool, warn: bool = True) -> tuple[Split, Split]:
    """Read the train and test splits from <data-dir>/cifar-10-batches-py into CPU uint8 tensors; `warn`: as
    verify_files."""
    folder = data_dir / BASE_FOLDER
    if not data_dir.is_dir():
        raise DataError(f"data dir {shown(data_dir)} does not exist; create it with: python -m trainer.data synth --out {shown(data_dir)}")
    verify_files(folder, allow_unverified, warn)
    return _load_split(folder, TRAIN_FILES), _load_split(folder, TEST_FILES)


def _load_split(folder: Path, files: tuple[tuple[str, str], ...]) -> Split:
    parts = [_read_batch(folder / name) for name, _ in files]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return Split(images.contiguous(), labels)


# ---------------------------------------------------------------- sharding and batched augmentation


def mix_seed(*parts: int) -> int:
    """A stable 63-bit seed from several integers (the same on every rank, every run)."""
    digest = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order; every rank computes the same one (DistributedSampler's set_epoch)."""
    g = torch.Generator().manual_seed(mix_seed(seed, epoch, 0xDA7A))
    return torch.randperm(n, generator=g)


def steps_in_epoch(n: int, start_sample: int, global_batch: int) -> int:
    """Full global batches left after start_sample; the last incomplete one is dropped."""
    return max(0, (n - start_sample) // global_batch)


def rank_slice(perm: torch.Tensor, start_sample: int, step: int, rank: int, batch: int, world: int) -> torch.Tensor:
    """Rank r's part of global batch ``step``: perm[start + step*G + r*B : ... + B] with G = world*B."""
    lo = start_sample + step * world * batch + rank * batch
    return perm[lo : lo + batch]


def crop_flip_params(seed: int, epoch: int, start_sample: int, step: int, count: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Crop offsets (0..2*PAD) and flip flags for a whole global batch.

    Seeded by the batch's position in the epoch, not by the rank, so each sample's augmentation is the
    same however the global batch is split over ranks (1 x 2B == 2 x B), and again after a resume.
    """
    g = torch.Generator(device=device).manual_seed(mix_seed(seed, epoch, start_sample + step * count, 0xA06))
    dx = torch.randint(0, 2 * PAD + 1, (count,), generator=g, device=device)
    dy = torch.randint(0, 2 * PAD + 1, (count,), generator=g, device=device)
    flip = torch.randint(0, 2, (count,), generator=g, device=device).bool()
    return dx, dy, flip


def crop_flip(images: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """RandomCrop(32, padding=4, fill 0) + horizontal flip of a uint8 batch in one gather."""
    n, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    pw = w + 2 * PAD
    ar_h = torch.arange(h, device=images.device)
    ar_w = torch.arange(w, device=images.device)
    rows = dy[:, None] + ar_h  # n x h
    cols = dx[:, None] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)  # n x w, reversed when flipped
    index = (rows[:, :, None] * pw + cols[:, None, :]).reshape(n, 1, h * w).expand(n, c, h * w)
    return padded.reshape(n, c, -1).gather(2, index).reshape(n, c, h, w)


_NORM_CACHE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _norm_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) of the per-channel standardisation, made once per device: a tensor built from Python
    numbers on a GPU is a blocking host-to-device copy, which once per step would keep the CPU from running
    ahead of the GPU."""
    if device not in _NORM_CACHE:
        std = torch.tensor(STD).view(1, 3, 1, 1)
        mean = torch.tensor(MEAN).view(1, 3, 1, 1)
        _NORM_CACHE[device] = ((1.0 / (std * 255)).to(device), (mean / std).to(device))
    return _NORM_CACHE[device]


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32, scaled and standardised per channel."""
    scale, shift = _norm_constants(images.device)
    return images.float().mul_(scale).sub_(shift)  # (x/255 - mean)/std, in place on the fresh float copy


class TrainLoader:
    """Yields this rank's augmented batches of one epoch from the device-resident uint8 training set."""

    def __init__(self, split: Split, batch_size: int, rank: int, world: int, seed: int) -> None:
        self.split, self.batch, self.rank, self.world, self.seed = split, batch_size, rank, world, seed

    @property
    def global_batch(self) -> int:
        return self.batch * self.world

    def steps(self, start_sample: int = 0) -> int:
        return steps_in_epoch(len(self.split), start_sample, self.global_batch)

    def batches(self, epoch: int, start_sample: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = self.split.images.device
        perm = epoch_permutation(len(self.split), self.seed, epoch).to(device)
        for step in range(self.steps(start_sample)):
            idx = rank_slice(perm, start_sample, step, self.rank, self.batch, self.world)
            dx, dy, flip = crop_flip_params(self.seed, epoch, start_sample, step, self.global_batch, device)
            part = slice(self.rank * self.batch, (self.rank + 1) * self.batch)
            x = crop_flip(self.split.images[idx], dx[part], dy[part], flip[part])
            yield normalize(x), self.split.labels[idx]


# ---------------------------------------------------------------- synthetic data (tests and the demo)

# One colour per class: the label is a simple function of the pixels (the image's mean colour), so a
# short run really learns; the noise makes single pixels uninformative.
_PALETTE = np.array(
    [[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40], [200, 40, 200],
     [40, 200, 200], [230, 230, 230], [20, 20, 20], [128, 128, 128], [230, 140, 20]], dtype=np.int16)


def synth_images(n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    labels = rng.integers(0, 10, size=n)
    noise = rng.integers(-50, 51, size=(n, 3, 32 * 32), dtype=np.int16)
    pixels = np.clip(_PALETTE[labels][:, :, None] + noise, 0, 255).astype(np.uint8)
    return pixels.reshape(n, 3072), [int(v) for v in labels]


def _batch_bytes(data: np.ndarray, labels: list[int], batch_label: str) -> bytes:
    entry = {
        "batch_label": batch_label, "labels": labels, "data": data,
        "filenames": [f"synthetic_{i:06d}.png" for i in range(len(labels))],
    }
    return pickle.dumps(entry, protocol=2)  # protocol 2, like the official (Python 2 era) files


def synth_files(n_train: int, n_test: int, seed: int) -> dict[str, bytes]:
    """The official file set (5 train batches, test batch, meta) with synthetic pixels, as name -> bytes."""
    rng = np.random.default_rng(seed)
    files: dict[str, bytes] = {}
    sizes = [n_train // 5 + (1 if i < n_train % 5 else 0) for i in range(5)]
    for i, size in enumerate(sizes, start=1):
        data, labels = synth_images(size, rng)
        files[f"data_batch_{i}"] = _batch_bytes(data, labels, f"training batch {i} of 5")
    data, labels = synth_images(n_test, rng)
    files[TEST_FILES[0][0]] = _batch_bytes(data, labels, "testing batch 1 of 1")
    meta = {"num_cases_per_batch": max(sizes), "label_names": list(CLASSES), "num_vis": 3072}
    files[META_FILE[0]] = pickle.dumps(meta, protocol=2)
    return files


# 10x CIFAR-10's training set (3 KB an image: 1.5 GB on disk, held in memory while written); more is a typo.
MAX_SYNTH = 500_000


def write_synthetic(out: Path, n_train: int = 50000, n_test: int = 10000, seed: int = 0,
                    archive: Path | None = None) -> Path:
    """Write <out>/cifar-10-batches-py (and optionally the .tar.gz in the official layout)."""
    if not (5 <= n_train <= MAX_SYNTH and 1 <= n_test <= MAX_SYNTH):
        raise DataError(f"synthetic set needs --train between 5 and {MAX_SYNTH} and --test between 1 and "
                        f"{MAX_SYNTH}, got {n_train}/{n_test}")
    files = synth_files(n_train, n_test, seed)
    folder = out / BASE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        (folder / name).write_bytes(blob)
    if archive is not None:
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            for name, blob in files.items():
                info = tarfile.TarInfo(f"{BASE_FOLDER}/{name}")
                info.size, info.mode = len(blob), 0o644
                tar.addfile(info, io.BytesIO(blob))
    return folder


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m trainer.data", description="CIFAR-10 data tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="write a synthetic data set in the official layout")
    s.add_argument("--out", type=Path, required=True, help=f"data dir ({BASE_FOLDER}/ is created in it)")
    s.add_argument("--train", type=int, default=50000)
    s.add_argument("--test", type=int, default=10000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--archive", type=Path, default=None, help=f"also write this {ARCHIVE_NAME}")
    try:
        args = p.parse_args(argv)
        folder = write_synthetic(args.out, args.train, args.test, args.seed, args.archive)
    except (TrainerError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(f"wrote {args.train} train + {args.test} test synthetic images to {folder}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
