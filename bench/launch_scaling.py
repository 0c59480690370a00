"""Launch scaling: time for `up --detach` to have every container running on 1, 2, 4 and 8 test hosts,
against the same work done one host after another (a 1-node `up --detach` per host, in turn).

    sudo .venv/bin/python bench/launch_scaling.py [--repeats 3] [--sizes 1 2 4 8] [--image ddp-cifar:cpu]

Needs root, the local dockerd and `make image-cpu`. One devcluster of the largest size is made (and removed); a warm-up
`up` moves the image and the data first, so the timings are launch only: SSH, preflight, image/data checks
(nothing moved), container start. Prints a table (median seconds), the ratio largest / 1 host and parallel /
one after another; exits 1 past GOAL_SCALING or when the fan-out is slower than one host after another
(bench/bounds.py). The test hosts share this machine's cores, so the first needs a core per host to hold.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

from devcluster import Cluster  # noqa: E402

GOAL_SCALING = 1.5  # the goal: the largest size at most 1.5x as long as 1 host

TRAIN = ["--model", "tiny", "--epochs", "1000", "--batch-size", "16", "--allow-unverified-data"]


def orchestrate(env: dict[str, str], *args: str) -> float:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "orchestrate", *args], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    took = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"orchestrate {' '.join(args[:1])} failed:\n{res.stdout}\n{res.stderr}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--image", default="ddp-cifar:cpu")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="launch-scaling-"))
    subprocess.run([sys.executable, "-m", "trainer.data", "synth", "--out", str(work / "synth"), "--train", "256",
                    "--test", "128", "--archive", str(work / "c.tar.gz")], check=True, cwd=REPO, timeout=120,
                   capture_output=True)
    md5 = hashlib.md5((work / "c.tar.gz").read_bytes()).hexdigest()
    largest = max(args.sizes)
    with Cluster.create(largest) as cluster:
        server = http.server.ThreadingHTTPServer(
            (cluster.gateway, 0), partial(http.server.SimpleHTTPRequestHandler, directory=str(work)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://{cluster.gateway}:{server.server_address[1]}/c.tar.gz"
        env = {**cluster.client_env(), "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(work / "state")}
        keys = {i: {"data_dir": str(work / f"n{i}" / "data"), "ckpt_dir": str(work / f"n{i}" / "ck" / "{job}")}
                for i in range(largest)}

        def hosts_file(name: str, hosts: list) -> Path:  # type: ignore[type-arg]
            return cluster.write_hosts_file(work / f"{name}.txt", keys=keys, hosts=hosts)

        def up(hosts: Path, job: str) -> float:
            took = orchestrate(env, "up", "--detach", "--hosts", str(hosts), "--job", job, "--gpus", "0",
                               "--image", args.image, "--data-url", url, "--data-md5", md5, "--", *TRAIN)
            orchestrate(env, "kill", "--hosts", str(hosts), "--job", job, "--grace", "2")
            return took

        warm = up(hosts_file("all", cluster.hosts), "warmup")  # moves the image and the data once
        print(f"warm-up (image + data to {largest} hosts): {warm:.1f} s", flush=True)
        rows = []
        for n in args.sizes:
            chosen = cluster.hosts[:n]
            parallel = [up(hosts_file(f"p{n}", chosen), f"par{n}") for _ in range(args.repeats)]
            serial = [sum(up(hosts_file(f"s{n}-{h.index}", [h]), f"ser{n}-{h.index}") for h in chosen)
                      for _ in range(args.repeats)]
            rows.append((n, statistics.median(parallel), statistics.median(serial)))
            print(f"{n} host(s): parallel {rows[-1][1]:.2f} s, one after another {rows[-1][2]:.2f} s", flush=True)
        server.shutdown()
    print("\n| hosts | `up --detach` (parallel fan-out) | same work, one host after another |")
    print("|------:|---------------------------------:|----------------------------------:|")
    for n, par, ser in rows:
        print(f"| {n} | {par:.2f} s | {ser:.2f} s |")
    (n1, par1, _), (n, par, ser) = rows[0], rows[-1]
    print(f"\nmedian of {args.repeats}; {os.cpu_count()} CPU cores shared by all hosts")
    return finish([Figure(f"`up --detach` on {n} hosts / on {n1}", par / par1, "x", f"{n1} host(s) {par1:.2f} s",
                          GOAL_SCALING, False),
                   Figure(f"`up --detach` on {n} hosts / one host after another", par / ser, "x",
                          f"one after another {ser:.2f} s", 1.0, False)])


if __name__ == "__main__":
    sys.exit(main())
