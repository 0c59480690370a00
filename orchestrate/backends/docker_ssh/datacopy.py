"""I/O: whether a node's data folder holds a verified copy of the data (the marker backends/docker_ssh/data.py writes)."""

from __future__ import annotations

import posixpath

from orchestrate.labels import DATA_MARKER
from orchestrate.remote.ssh import Connection
from trainer.contract import BASE_FOLDER

MARKER = DATA_MARKER


BATCHES = BASE_FOLDER


def has_verified_copy(conn: Connection, data_dir: str, md5: str) -> bool:
    res = conn.run(["sh", "-c", 'test -d "$2" && cat -- "$1"', "marker", posixpath.join(data_dir, MARKER),
                    posixpath.join(data_dir, BATCHES)], timeout=30)
    return res.rc == 0 and res.out.strip() == md5
