"""`python -m devcluster up --images ...`: the images reach Cluster.create (whose seeding is tested on real hosts in
tests/cluster/test_devcluster.py); Cluster.create is replaced here, since a real one needs root and minutes."""

from __future__ import annotations

from typing import Any

import pytest

from devcluster import cli


def test_up_passes_the_images_every_host_starts_with(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    made: list[dict[str, Any]] = []

    def create(n_hosts: int, name: str | None, **kwargs: Any) -> None:
        made.append({"n_hosts": n_hosts, **kwargs})
        raise cli.DevclusterError("stop here")  # the fake makes nothing: the CLI prints its error line

    monkeypatch.setattr(cli.Cluster, "create", create)
    assert cli.main(["up", "--hosts", "16", "--images", "ddp-cifar:cpu", "other:1"]) == 2
    assert made[0]["n_hosts"] == 16 and made[0]["images"] == ["ddp-cifar:cpu", "other:1"]
    assert cli.main(["up", "--hosts", "2"]) == 2 and made[1]["images"] == []
    assert "error: stop here" in capsys.readouterr().err
