"""Image delivery after a code change: bytes and seconds for `up` to give 2 and 4 test hosts the new image, the
full transfer, the layer delta from `docker save` and the layer delta from the local layer cache, in one run.

    sudo .venv/bin/python bench/image_delta.py [--image ddp-cifar:cpu]

Needs root, the local dockerd, Debian's docker-registry and the CPU image built from this tree's Dockerfile. For
each host count a fresh devcluster is made (and removed):
  1. `up --layer-cache off` of IMAGE sends the whole image (what every `up` after a code change sent before
     layer-aware transfer): the baseline;
  2. IMAGE rebuilt with one line added to trainer/, `up --layer-cache off`: the delta filtered from `docker save`;
  3. rebuilt again with another line, `up --layer-cache on`: the delta from the local layer cache. The cache (a
     folder of this run) already holds IMAGE, as after any earlier `up`; the time to fill an empty cache with
     IMAGE, paid once per machine, is printed too.
All are 1-step jobs; the figure is the `image` phase of `up --timings` and the per-node summary "sent N MB (k of
m layers)". Exits 1 past a goal (GOAL_MB, GOAL_SPEEDUP; bench/bounds.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import docker  # noqa: E402
from bounds import Figure, finish  # noqa: E402
from kit.image_kit import build_changed_image  # noqa: E402
from kit.orchestrate_kit import host_dirs, serve_data  # noqa: E402

from devcluster import Cluster  # noqa: E402

GOAL_MB = 1.0  # the goals: at most 1 MB per node after a trainer/ change,
GOAL_SPEEDUP = 20.0  # and an image phase at least 20x faster than the full transfer

TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--max-steps", "1"]
SENT = re.compile(r"image \S+ on (\S+): sent ([\d.]+) MB \((\d+) of (\d+) layers?\) of (\d+) MB")
IMAGE_PHASE = re.compile(r"timings \(s\):.*?\bimage ([\d.]+)")


def up(cluster: Cluster, work: Path, hosts: Path, url: str, md5: str, image: str, job: str,
       cache: str) -> tuple[float, list]:
    env = {**cluster.client_env(), "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(work / "state"),
           "XDG_CACHE_HOME": str(work / "cache")}
    res = subprocess.run([sys.executable, "-m", "orchestrate", "up", "--timings", "--hosts", str(hosts), "--job", job,
                          "--gpus", "0", "--image", image, "--data-url", url, "--data-md5", md5,
                          "--layer-cache", cache, "--relay", "off", "--", *TRAIN],  # per node, as sent from here
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    phase = IMAGE_PHASE.search(res.stdout)
    if res.returncode != 0 or phase is None:
        raise SystemExit(f"up failed:\n{res.stdout}\n{res.stderr}")
    return float(phase[1]), [(m[1], float(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in SENT.finditer(res.stdout)]


def fill_cache(work: Path, image: str) -> float:
    """Seconds to push IMAGE into the empty layer cache of this run (once per machine in real use)."""
    from orchestrate.backends.docker_ssh.layercache import LayerCache, registry_binary

    binary = registry_binary()
    if binary is None:
        raise SystemExit("docker-registry is missing: apt-get install docker-registry")
    local = docker.from_env(timeout=600)
    found = local.images.get(image)
    start = time.monotonic()
    with LayerCache.started(binary, work / "cache" / "ddp-cifar" / "layers") as cache:
        cache.put(local, str(found.id), len(found.attrs["RootFS"]["Layers"]), lambda event: None)
    return time.monotonic() - start


def row(n: int, what: str, seconds: float, sent: list, base: float) -> str:
    return (f"| {n} | {what} | {max(s[1] for s in sent):.2f} MB ({sent[0][2]} of {sent[0][3]}) | {seconds:.2f} s "
            f"| {base / seconds:.0f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="ddp-cifar:cpu")
    args = parser.parse_args()
    changed = [f"{args.image}-bench-change-{k}" for k in (1, 2)]
    work = Path(tempfile.mkdtemp(prefix="image-delta-"))
    print(f"filling an empty layer cache with {args.image}: {fill_cache(work, args.image):.1f} s", flush=True)
    rows, figures = [], []
    try:
        for n in (2, 4):
            with Cluster.create(n) as cluster, serve_data(work / f"served{n}", cluster.gateway) as data:
                hosts = cluster.write_hosts_file(work / f"hosts{n}.txt", keys=host_dirs(work / f"c{n}", n))
                full_s, full = up(cluster, work, hosts, data.url, data.md5, args.image, "full", "off")
                build_changed_image(args.image, changed[0], line=f"run {n} save")
                save_s, save = up(cluster, work, hosts, data.url, data.md5, changed[0], "save", "off")
                build_changed_image(args.image, changed[1], line=f"run {n} cache")
                cache_s, cache = up(cluster, work, hosts, data.url, data.md5, changed[1], "cache", "on")
            rows += [row(n, "full image (baseline)", full_s, full, full_s),
                     row(n, "delta from docker save", save_s, save, full_s),
                     row(n, "delta from the layer cache", cache_s, cache, full_s)]
            print("\n".join(rows[-3:]), flush=True)
            figures += [Figure(f"{n} hosts: sent per node after a trainer/ change", max(c[1] for c in cache), "MB",
                               f"full image {max(f[1] for f in full):.0f} MB", GOAL_MB, False),
                        Figure(f"{n} hosts: image phase, full / layer cache", full_s / cache_s, "x",
                               f"full image {full_s:.1f} s, layer cache {cache_s:.2f} s", GOAL_SPEEDUP, True)]
    finally:
        for tag in changed:
            try:
                docker.from_env().images.remove(tag)
            except docker.errors.APIError:
                pass
    print("\n| hosts | image delivery | sent per node (layers) | image phase | faster than the full image |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    return finish(figures)


if __name__ == "__main__":
    sys.exit(main())
