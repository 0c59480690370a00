"""Data on disk (official layout, md5, hostile files) and in memory (shards, batched augmentation). Unit tests."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import data
from trainer.errors import DataError


def test_synth_writes_the_official_layout_and_pickle_format(tmp_path: Path) -> None:
    folder = data.write_synthetic(tmp_path, 23, 7, archive=tmp_path / "a" / data.ARCHIVE_NAME)
    assert sorted(p.name for p in folder.iterdir()) == sorted(n for n, _ in data.ALL_FILES)
    # The official files load with encoding="bytes" (torchvision uses latin1); ours must too.
    entry = pickle.loads((folder / "data_batch_1").read_bytes(), encoding="bytes")
    assert entry["data"].dtype == np.uint8 and entry["data"].shape == (5, 3072)
    assert len(entry["labels"]) == 5 and len(entry["filenames"]) == 5 and "batch_label" in entry
    meta = pickle.loads((folder / "batches.meta").read_bytes(), encoding="latin1")
    assert meta["label_names"][0] == "airplane"
    with tarfile.open(tmp_path / "a" / data.ARCHIVE_NAME) as tar:
        assert f"{data.BASE_FOLDER}/test_batch" in tar.getnames()


def test_synth_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert data.main(["synth", "--out", str(tmp_path), "--train", "10", "--test", "4"]) == 0
    train, test = data.load_cifar(tmp_path, allow_unverified=True)
    assert train.images.shape == (10, 3, 32, 32) and len(test) == 4
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64


def test_unverified_data_is_refused_without_the_flag(data_dir: Path) -> None:
    with pytest.raises(DataError, match="do not match the official CIFAR-10 md5.*--allow-unverified-data"):
        data.load_cifar(data_dir, allow_unverified=False)


def test_missing_file_names_it_and_says_what_to_do(tmp_path: Path) -> None:
    data.write_synthetic(tmp_path, 10, 2)
    (tmp_path / data.BASE_FOLDER / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3 is missing.*trainer.data synth"):
        data.load_cifar(tmp_path, allow_unverified=True)


def test_missing_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        data.load_cifar(tmp_path / "nope", allow_unverified=True)


def test_truncated_batch_is_reported_as_corrupt(tmp_path: Path) -> None:
    data.write_synthetic(tmp_path, 10, 2)
    f = tmp_path / data.BASE_FOLDER / "data_batch_2"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(DataError, match="data_batch_2 is corrupt"):
        data.load_cifar(tmp_path, allow_unverified=True)


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    data.write_synthetic(tmp_path, 10, 2)
    marker = tmp_path / "owned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path.touch, (marker,))

    (tmp_path / data.BASE_FOLDER / "test_batch").write_bytes(pickle.dumps({"data": Evil()}, protocol=2))
    with pytest.raises(DataError, match="corrupt.*forbidden"):
        data.load_cifar(tmp_path, allow_unverified=True)
    assert not marker.exists()


def test_archive_is_extracted_and_its_md5_checked(tmp_path: Path) -> None:
    archive = tmp_path / "src" / data.ARCHIVE_NAME
    data.write_synthetic(tmp_path / "src", 10, 2, archive=archive)
    target = tmp_path / "only-archive"
    target.mkdir()
    (target / data.ARCHIVE_NAME).write_bytes(archive.read_bytes())
    with pytest.raises(DataError, match="official md5"):
        data.extract_archive(target, allow_unverified=False)
    data.extract_archive(target, allow_unverified=True)
    train, _ = data.load_cifar(target, allow_unverified=True)
    assert len(train) == 10


# ------------------------------------------------------------------ sharding


def _epoch_indices(n: int, batch: int, world: int, seed: int, epoch: int, start: int = 0) -> list[list[int]]:
    perm = data.epoch_permutation(n, seed, epoch)
    steps = data.steps_in_epoch(n, start, batch * world)
    return [torch.cat([data.rank_slice(perm, start, s, r, batch, world) for s in range(steps)]).tolist()
            for r in range(world)]


def test_shards_are_disjoint_and_cover_the_epoch() -> None:
    shards = _epoch_indices(1000, 25, 4, seed=0, epoch=0)  # G = 100 divides 1000: full coverage
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 1000
    assert all(len(s) == 250 for s in shards)


def test_last_incomplete_global_batch_is_dropped_and_nothing_repeats() -> None:
    shards = _epoch_indices(1010, 25, 4, seed=0, epoch=0)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 1000


def test_shards_change_with_the_epoch_and_repeat_with_the_seed() -> None:
    a = _epoch_indices(512, 16, 2, seed=5, epoch=0)
    assert a == _epoch_indices(512, 16, 2, seed=5, epoch=0)
    assert a != _epoch_indices(512, 16, 2, seed=5, epoch=1)
    assert a != _epoch_indices(512, 16, 2, seed=6, epoch=0)


def test_global_batches_do_not_depend_on_how_they_are_split() -> None:
    """1 x 2B and 2 x B see the same samples step by step (what makes DDP equivalent to one big batch)."""
    one = _epoch_indices(512, 32, 1, seed=3, epoch=2)[0]
    two = _epoch_indices(512, 16, 2, seed=3, epoch=2)
    merged = [i for s in range(16) for r in range(2) for i in two[r][s * 16:(s + 1) * 16]]
    assert merged == one


def test_resume_offset_continues_the_same_order() -> None:
    full = _epoch_indices(512, 16, 1, seed=0, epoch=0)[0]
    rest = _epoch_indices(512, 16, 1, seed=0, epoch=0, start=160)[0]
    assert rest == full[160:]


# ------------------------------------------------------------------ augmentation


def test_crop_flip_matches_a_per_image_reference() -> None:
    g = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=g)
    dx = torch.tensor([0, 8, 4, 2, 8, 0])
    dy = torch.tensor([0, 8, 4, 7, 0, 3])
    flip = torch.tensor([False, True, False, True, True, False])
    out = data.crop_flip(imgs, dx, dy, flip)
    padded = torch.nn.functional.pad(imgs, (4, 4, 4, 4))
    for i in range(6):
        ref = padded[i, :, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
        if flip[i]:
            ref = ref.flip(-1)
        assert torch.equal(out[i], ref), i
    assert torch.equal(out[2], imgs[2])  # offset 4,4 without flip is the identity


def test_augmentation_is_reproducible_and_uses_all_offsets() -> None:
    cpu = torch.device("cpu")
    a = data.crop_flip_params(1, 2, 0, 3, 4096, cpu)
    b = data.crop_flip_params(1, 2, 0, 3, 4096, cpu)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert set(a[0].tolist()) == set(range(9)) and 0.4 < a[2].float().mean() < 0.6
    c = data.crop_flip_params(1, 2, 0, 4, 4096, cpu)
    assert not torch.equal(a[0], c[0])


def test_normalize_standardises_per_channel() -> None:
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    y = data.normalize(x)
    expect = (1 - torch.tensor(data.MEAN)) / torch.tensor(data.STD)
    assert torch.allclose(y[0, :, 0, 0], expect, atol=1e-5)


def test_loader_yields_float_batches_for_this_rank() -> None:
    imgs = torch.randint(0, 256, (100, 3, 32, 32), dtype=torch.uint8)
    split = data.Split(imgs, torch.arange(100) % 10)
    loader = data.TrainLoader(split, batch_size=8, rank=1, world=3, seed=0)
    batches = list(loader.batches(epoch=0))
    assert len(batches) == loader.steps() == 4
    x, y = batches[0]
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32) and y.shape == (8,)
