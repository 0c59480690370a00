"""Test hosts: how long a devcluster of 1, 2 and 4 hosts takes to come up and go, and what seeding saves: a
seeded 2-host cluster (every host starts with the CPU image, devcluster/seed.py) against loading the image into
one fresh host (`docker save | docker load`, what each host cost before seeding).

    sudo .venv/bin/python bench/devcluster_hosts.py [--reps 3] [--image ddp-cifar:cpu]

Needs root, the local dockerd and the CPU image. Median seconds; up = until every dockerd answers `/_ping` and
every sshd listens; down = until no trace is left (devcluster/bench.py). The first seeded cluster after an image
build makes the seed (once per build): run the bench twice after a rebuild. Exits 1 past a bound (bench/bounds.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from bounds import Figure, finish  # noqa: E402
from kit.image_kit import load_image  # noqa: E402

from devcluster import Cluster  # noqa: E402
from devcluster.bench import bench  # noqa: E402

MAX_UP_S = 3.0  # 4 hosts up: the tests make clusters freely because this stays a few seconds
MAX_DOWN_S = 3.0
MIN_SEED_GAIN = 10.0  # a seeded 2-host cluster against one host loading the image


def seeded_up(image: str, reps: int) -> float:
    """Median seconds for a 2-host cluster whose hosts start with `image`."""
    took = []
    for _ in range(reps):
        start = time.monotonic()
        with Cluster.create(2, images=(image,)):
            took.append(time.monotonic() - start)
    return statistics.median(took)


def loaded(image: str) -> float:
    """Seconds to load `image` into a fresh host's dockerd."""
    with Cluster.create(1) as cluster:
        start = time.monotonic()
        load_image(image, cluster.hosts[0].docker_host)
        return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n", 1)[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--image", default="ddp-cifar:cpu")
    args = p.parse_args()
    rows = bench((1, 2, 4), args.reps)
    print("| hosts | up | down |\n|---:|---:|---:|")
    for n, up, down in rows:
        print(f"| {n} | {up:.2f} | {down:.2f} |")
    seeded, load = seeded_up(args.image, args.reps), loaded(args.image)
    print(f"seeded 2-host cluster up: {seeded:.2f} s; the image loaded into one fresh host: {load:.1f} s")
    _, up4, down4 = rows[-1]
    return finish([Figure("4 hosts up", up4, "s", f"1 host {rows[0][1]:.2f} s", MAX_UP_S, False),
                   Figure("4 hosts down", down4, "s", f"1 host {rows[0][2]:.2f} s", MAX_DOWN_S, False),
                   Figure("seeded 2-host cluster up / loading the image into one host", load / seeded, "x faster",
                          f"loading {load:.1f} s, seeded {seeded:.2f} s", MIN_SEED_GAIN, True)])


if __name__ == "__main__":
    sys.exit(main())
