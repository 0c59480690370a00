"""What a seeded host's data root shares with its seed (devcluster/seed.py `plant`), on a folder made here: real
seeding needs root, a dockerd and minutes (tests/cluster/test_devcluster.py)."""

from __future__ import annotations

import os
from pathlib import Path

from devcluster.layout import HostLayout
from devcluster.seed import plant


def test_a_planted_host_links_the_seeds_files_but_owns_each_layers_committed_mark(tmp_path: Path) -> None:
    """dockerd rewrites a layer's `committed` mark in place when it pushes the layer: through a link, a push from
    one seeded host changed the seed's file, and so every host's made from it (seen as a new mtime on the seed's
    mark while another test compared the seed's listing). Everything else stays a link (no copy of 0.9 GB)."""
    seed = tmp_path / "seed"
    for part, name in (("image", "overlay2/repositories.json"), ("overlay2", "abc/diff/file"),
                       ("overlay2", "abc/committed"), ("overlay2", "abc/link")):
        path = seed / part / name if part == "image" else seed / "overlay2" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
    host = HostLayout("c", 0, "10.0.0.2", tmp_path / "h0")
    plant(seed, host)
    root = host.data_root
    assert (root / "overlay2/abc/committed").read_text() == "abc/committed"
    assert not os.path.samefile(root / "overlay2/abc/committed", seed / "overlay2/abc/committed")
    for shared in ("overlay2/abc/diff/file", "overlay2/abc/link", "image/overlay2/repositories.json"):
        assert os.path.samefile(root / shared, seed / shared), shared
    assert sorted(p.name for p in (root / "overlay2/abc").iterdir()) == ["committed", "diff", "link"]
