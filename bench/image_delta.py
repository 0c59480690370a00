"""Image delivery after a code change: bytes and seconds for `up` to give 2 and 4 test hosts the new image,
layer delta beside the full transfer, in one run.

    sudo .venv/bin/python bench/image_delta.py [--image ddp-cifar:cpu]

Needs root, the local dockerd and the CPU image built from this tree's Dockerfile. For each host count a fresh
devcluster is made (and removed): a first `up` of IMAGE sends the whole image (what every `up` after a code
change sent before layer-aware transfer), then IMAGE is rebuilt with one line added to trainer/ and the next
`up` sends what the nodes lack. Both are 1-step jobs; the figure is the `image` phase of `up --timings` and the
per-node summary "sent N MB (k of m layers)".
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "cluster")]

import docker  # noqa: E402
from image_kit import build_changed_image  # noqa: E402
from orchestrate_kit import host_dirs, serve_data  # noqa: E402

from devcluster import Cluster  # noqa: E402

TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--max-steps", "1"]
SENT = re.compile(r"image \S+ on (\S+): sent ([\d.]+) MB \((\d+) of (\d+) layers?\) of (\d+) MB")
IMAGE_PHASE = re.compile(r"timings \(s\):.*?\bimage ([\d.]+)")


def up(cluster: Cluster, work: Path, hosts: Path, url: str, md5: str, image: str, job: str) -> tuple[float, list]:
    env = {**cluster.client_env(), "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(work / "state")}
    res = subprocess.run([sys.executable, "-m", "orchestrate", "up", "--timings", "--hosts", str(hosts), "--job", job,
                          "--gpus", "0", "--image", image, "--data-url", url, "--data-md5", md5, "--", *TRAIN],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    phase = IMAGE_PHASE.search(res.stdout)
    if res.returncode != 0 or phase is None:
        raise SystemExit(f"up failed:\n{res.stdout}\n{res.stderr}")
    return float(phase[1]), [(m[1], float(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in SENT.finditer(res.stdout)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="ddp-cifar:cpu")
    args = parser.parse_args()
    changed = f"{args.image}-bench-change"
    work = Path(tempfile.mkdtemp(prefix="image-delta-"))
    rows = []
    try:
        for n in (2, 4):
            with Cluster.create(n) as cluster, serve_data(work / f"served{n}", cluster.gateway) as data:
                hosts = cluster.write_hosts_file(work / f"hosts{n}.txt", keys=host_dirs(work / f"c{n}", n))
                full_s, full = up(cluster, work, hosts, data.url, data.md5, args.image, "full")
                build_changed_image(args.image, changed, line=f"run {n}")
                delta_s, delta = up(cluster, work, hosts, data.url, data.md5, changed, "delta")
            rows.append((n, full_s, full, delta_s, delta))
            print(f"{n} hosts: full {full_s:.1f} s {full}; delta {delta_s:.2f} s {delta}", flush=True)
    finally:
        try:
            docker.from_env().images.remove(changed)
        except docker.errors.APIError:
            pass
    print("\n| hosts | full image: MB sent per node | image phase | after a trainer/ change: MB sent per node "
          "(layers) | image phase | faster |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, full_s, full, delta_s, delta in rows:
        print(f"| {n} | {max(f[1] for f in full):.1f} | {full_s:.1f} s | {max(d[1] for d in delta):.2f} "
              f"({delta[0][2]} of {delta[0][3]}) | {delta_s:.2f} s | {full_s / delta_s:.0f}x |")
    print("\ngoal: <= 1 MB per node after a trainer/ change, image phase >= 20x faster than the full transfer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
