"""--data-from DIR: the local manifest, what is sent, and the tar stream that carries it."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrate.backends.docker_ssh.staging import (
    Entry,
    changed_files,
    local_manifest,
    tar_stream,
    unpack_command,
)
from orchestrate.errors import ConfigError


def tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(os.urandom(70_000))  # not a multiple of 512
    return root


def test_manifest_sizes_and_hashes_every_file(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    m = local_manifest(src)
    assert sorted(m) == ["a.txt", "sub/b.bin"]
    assert m["a.txt"] == Entry(5, hashlib.sha256(b"alpha").hexdigest())
    (src / "link").symlink_to(src / "a.txt")  # inside: its content travels as a file
    assert local_manifest(src)["link"] == m["a.txt"]
    assert local_manifest(src / "a.txt") == {"a.txt": m["a.txt"]}  # a single file


def test_bad_sources_are_refused_before_anything_moves(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    (src / "escape").symlink_to("/etc/hostname")
    with pytest.raises(ConfigError, match=r"symlink to /etc/hostname, outside"):
        local_manifest(src)
    (src / "escape").unlink()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no files in it"):
        local_manifest(tmp_path / "empty")


def test_an_unreadable_source_file_is_refused(shared_tmp: Path,
                                              run_as_nobody: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """As the unprivileged account `nobody` (root reads any file, whatever its mode), in a process of its own."""
    src = tree(shared_tmp / "src")
    (src / "sub" / "b.bin").chmod(0)
    probe = ("import pathlib, sys\nfrom orchestrate.errors import ConfigError\nfrom orchestrate.backends.docker_ssh.staging import "
             "local_manifest\ntry:\n    local_manifest(pathlib.Path(sys.argv[1]))\nexcept ConfigError as e:\n"
             "    print(e)\n    sys.exit(3)")
    res = run_as_nobody(["-c", probe, str(src)], shared_tmp)
    assert res.returncode == 3, res.stderr
    assert res.stdout.strip() == f"--data-from {src}: cannot read {src}/sub/b.bin: Permission denied"


def test_only_missing_or_different_files_are_sent() -> None:
    local = {"a": Entry(1, "x"), "b": Entry(2, "y"), "c": Entry(3, "z")}
    assert changed_files(local, {}) == ["a", "b", "c"]
    assert changed_files(local, dict(local)) == []
    assert changed_files(local, {**local, "b": Entry(2, "corrupt"), "extra": Entry(9, "q")}) == ["b"]


def test_the_tar_stream_unpacks_to_the_same_files(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    seen: list[int] = []
    data = b"".join(tar_stream(src, ["a.txt", "sub/b.bin"], seen.append))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["a.txt", "sub/b.bin"]
        assert tar.extractfile("sub/b.bin").read() == (src / "sub" / "b.bin").read_bytes()  # type: ignore[union-attr]
    assert seen[-1] == 70_005 and len(data) % 512 == 0


def test_a_file_that_cannot_be_renamed_into_place_fails_the_unpack_though_a_later_one_succeeds(
        tmp_path: Path) -> None:
    """`mv` fails for the first of two files (a disk gone read-only, a folder in the way): the node's script fails.
    Before, the rename loop's status was its last file's: a failed rename was hidden and the staging reported as
    done, the node training on the old file."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.bin").write_bytes(b"a" * 10)
    (source / "b.bin").write_bytes(b"b" * 10)
    tar = b"".join(tar_stream(source, ["a.bin", "b.bin"], lambda n: None))
    bin_dir, data_dir = tmp_path / "bin", tmp_path / "data"
    bin_dir.mkdir()
    data_dir.mkdir()
    (bin_dir / "mv").write_text('#!/bin/sh\ncase "$*" in *a.bin*) exit 1;; esac\nexec /bin/mv "$@"\n')
    (bin_dir / "mv").chmod(0o755)
    res = subprocess.run(unpack_command(str(data_dir)), input=tar, capture_output=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert res.returncode != 0
    assert not (data_dir / "a.bin").exists()
