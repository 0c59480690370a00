"""The fetch script (run here under python, as in the node's container) into a data folder too small for it: a
256 KB tmpfs (needs root, as the suite runs). It fails with exit 6 and one line giving the space needed; nothing
partial is left and nothing is marked verified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kit.disks import tmpfs
from kit.fetching import archive, fetch, quiet_folder, serving

from orchestrate.backends.docker_ssh import data as prefetch


@pytest.mark.parametrize(("payload", "what"), [
    (os.urandom(400_000), "the download"),  # incompressible: the archive itself does not fit
    (bytes(1_000_000), "extracting the archive"),  # zeros: a 1 KB archive that expands to 1 MB
])
def test_a_data_folder_too_small_fails_in_one_line_and_leaves_nothing_partial(
        tmp_path: Path, payload: bytes, what: str) -> None:
    (tmp_path / "www").mkdir()
    md5 = archive(tmp_path / "www" / "c.tar.gz", payload)
    with serving(quiet_folder(tmp_path / "www")) as base, tmpfs(tmp_path / "data", "size=256k") as data:
        res = fetch(f"{base}/c.tar.gz", md5, data)
        assert res.returncode == 6, res.stdout + res.stderr
        errors = [line for line in res.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: no space left for {what}: it needs ")
        assert "free some space there or choose another data dir" in errors[0]
        left = sorted(p.name for p in data.iterdir())
        assert left == ([] if what == "the download" else [prefetch.ARCHIVE])  # no temp file, folder or marker
