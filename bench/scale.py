"""Scale: what one `up` costs the user's machine as the hosts grow, relayed inside the cluster (`--relay on`) against
each node sent its own copy from here (`--relay off`), on links shaped as a laptop's uplink.

    sudo .venv/bin/python bench/scale.py [--sizes 2 4 8] [--layer-mb 50] [--data-mb 20]

Needs root, tc (iproute2), the local dockerd and `make image-cpu` (the charlm example is built FROM it). One
devcluster of the largest size, seeded with the CPU image (the base is not the subject), is made and removed. The
links: the machine's side of the cluster's bridge (everything this machine sends to the hosts) 100 Mbit/s, each
host's own link 1 Gbit/s (tc tbf; the issue's 25 ms of delay needs sch_netem, which this machine's kernel lacks). Per size and mode, in turn (each `up` with an image and
data that no host holds yet): an image of the charlm example plus one layer of LAYER random bytes, and a
`--data-from` folder of DATA random bytes; an `up --detach` of 1 step on the first N hosts. Measured per `up`:
- bytes out of this machine: the bridge device's transmitted bytes (what this machine sends into the cluster;
  frames between hosts do not pass it);
- time until every node holds the image and the data: from the start of `up` to its first `data on` line (printed
  once the data phase, which follows the image phase, is done on every node);
- launcher CPU-seconds: this process's children's user + system time across the `up` (the orchestrator and
  whatever it runs here);
- SSH handshakes: new TCP connections from this machine to port 22 of the hosts (an iptables counter).
Ends through bench/bounds.py: at the largest size relayed, bytes out within 1.2x of one copy of the layer and data,
and the time within 1.5x of the relayed time at the smallest size (the issue's goals).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bounds import Figure, finish  # noqa: E402

from devcluster import Cluster  # noqa: E402

CPU_IMAGE = os.environ.get("DDP_TEST_IMAGE", "ddp-cifar:cpu")
# tbf, not netem: this machine's kernel has no sch_netem ("Specified qdisc kind is unknown"), so the uplink's 25 ms
# of delay is not applied; the rates are
UPLINK = ["tbf", "rate", "100mbit", "burst", "128kb", "latency", "400ms"]
HOST_LINK = ["tbf", "rate", "1gbit", "burst", "1mb", "latency", "100ms"]
GOAL_BYTES = 1.2  # x one copy of the new layer and the data, at the largest size
GOAL_TIME = 1.5  # x the smallest size's time
ARGS = ["--steps", "1", "--step-seconds", "0", "--ckpt-every", "1000", "--text", "input.txt", "--context", "4"]


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600).stdout


def charlm_image() -> str:
    tag = f"ddp-example-charlm:{CPU_IMAGE.rpartition(':')[2] or 'latest'}"
    subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE={CPU_IMAGE}", "-f", "examples/charlm/Dockerfile",
                    "-t", tag, "examples"], cwd=REPO, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return tag


def new_image(base: str, tag: str, size: int) -> None:
    """`tag`: base plus one layer of `size` random bytes (incompressible: it travels at its size)."""
    with tempfile.TemporaryDirectory(prefix="ddp-scale-") as tmp:
        Path(tmp, "blob").write_bytes(os.urandom(size))
        Path(tmp, "Dockerfile").write_text(f"FROM {base}\nCOPY blob /scale-bench-blob\n")
        subprocess.run(["docker", "build", "-q", "-t", tag, tmp], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "DOCKER_BUILDKIT": "0"})


def shape(c: Cluster) -> None:
    sh("tc", "qdisc", "replace", "dev", c.state.bridge, "root", *UPLINK)
    for h in c.state.hosts():
        sh("tc", "qdisc", "replace", "dev", h.veth, "root", *HOST_LINK)


def handshake_rule(c: Cluster) -> list[str]:
    return ["OUTPUT", "-d", c.subnet, "-p", "tcp", "--dport", "22", "--syn", "-m", "comment", "--comment",
            f"ddp-scale-bench:{c.name}", "-j", "ACCEPT"]


def handshakes(c: Cluster) -> int:
    for line in sh("iptables", "-L", "OUTPUT", "-v", "-x", "-n").splitlines():
        if f"ddp-scale-bench:{c.name}" in line:
            return int(line.split()[0])
    raise SystemExit("the handshake counter's iptables rule is gone")


def bytes_out(c: Cluster) -> int:
    return int(Path(f"/sys/class/net/{c.state.bridge}/statistics/tx_bytes").read_text())


def one_up(c: Cluster, work: Path, n: int, relay: str, image: str, data: Path, run: str) -> dict[str, float]:
    hosts = c.write_hosts_file(work / f"hosts-{run}.txt", hosts=c.hosts[:n],
                               keys={h.index: {"data_dir": f"/home/ddp/scale-{run}"} for h in c.hosts[:n]})
    env = {**c.client_env(), "XDG_STATE_HOME": str(work / "state"), "XDG_CACHE_HOME": str(work / "cache"),
           "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "orchestrate", "up", "--hosts", str(hosts), "--job", run, "--gpus", "0",
            "--image", image, "--entry", "-m charlm.train", "--data-from", str(data), "--relay", relay,
            "--grace", "10", "--detach", "--", *ARGS]
    before_out, before_ssh = bytes_out(c), handshakes(c)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    ready, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if ready is None and line.startswith("data on "):
            ready = time.monotonic() - t0
    rc = proc.wait(timeout=900)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0 or ready is None:
        raise SystemExit(f"up ({run}) failed, rc {rc}:\n{''.join(lines[-40:])}")
    got = {"out_mb": (bytes_out(c) - before_out) / 1e6, "ready_s": ready,
           "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
           "ssh": float(handshakes(c) - before_ssh)}
    subprocess.run([sys.executable, "-m", "orchestrate", "kill", "--job", run, "--grace", "5"], env=env, cwd=REPO,
                   capture_output=True, timeout=300)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layer-mb", type=int, default=50)
    p.add_argument("--data-mb", type=int, default=20)
    args = p.parse_args()
    layer, data_bytes = args.layer_mb * 1_000_000, args.data_mb * 1_000_000
    base = charlm_image()
    c = Cluster.create(max(args.sizes), images=(CPU_IMAGE,))
    work = Path(tempfile.mkdtemp(prefix="ddp-scale-"))
    rule = handshake_rule(c)
    tags: list[str] = []
    results: dict[tuple[int, str], dict[str, float]] = {}
    sh("iptables", "-I", *rule)
    try:
        # the charlm example's own layers onto every host first, unshaped: the runs then move only their new bytes
        warm = Path(work, "warm")
        warm.mkdir()
        Path(warm, "input.txt").write_text("to be or not to be, that is the question. " * 40)
        one_up_plain(c, work, base, warm)
        shape(c)
        for n in args.sizes:
            for relay in ("on", "off"):  # interleaved per size: the same machine's load for both
                run = f"s{n}{relay}"
                tag = f"ddp-scale-bench:{run}"
                new_image(base, tag, layer)
                tags.append(tag)
                data = Path(work, f"data-{run}")
                data.mkdir()
                Path(data, "input.txt").write_text("to be or not to be, that is the question. " * 40)
                Path(data, "blob.bin").write_bytes(os.urandom(data_bytes))
                results[(n, relay)] = one_up(c, work, n, relay, tag, data, run)
                r = results[(n, relay)]
                print(f"{n:>2} hosts --relay {relay:<3}: {r['out_mb']:7.1f} MB out, every node ready in "
                      f"{r['ready_s']:6.1f} s, launcher {r['cpu_s']:5.1f} CPU-s, {r['ssh']:3.0f} SSH handshakes",
                      flush=True)
    finally:
        subprocess.run(["iptables", "-D", *rule], capture_output=True, check=False)
        c.close()
        for tag in tags:
            subprocess.run(["docker", "rmi", tag], capture_output=True, check=False)
    return finish(report(results, args.sizes, (layer + data_bytes) / 1e6))


def one_up_plain(c: Cluster, work: Path, image: str, data: Path) -> None:
    """The base image onto every host (not timed): `up` of the largest size, unshaped."""
    one_up(c, work, len(c.hosts), "on", image, data, "warm")


def report(results: dict[tuple[int, str], dict[str, float]], sizes: list[int], copy_mb: float) -> list[Figure]:
    """The table printed; the figures with their bounds (at the largest size relayed)."""
    print(f"\none copy: {copy_mb:.0f} MB (the new layer and the data)")
    print(f"{'hosts':>5} | {'MB out relay/off':>17} | {'ready s relay/off':>17} | {'CPU-s relay/off':>15} | "
          f"{'SSH relay/off':>13}")
    for n in sizes:
        on, off = results[(n, "on")], results[(n, "off")]
        print(f"{n:>5} | {on['out_mb']:7.1f} / {off['out_mb']:7.1f} | {on['ready_s']:7.1f} / {off['ready_s']:7.1f} | "
              f"{on['cpu_s']:6.1f} / {off['cpu_s']:6.1f} | {on['ssh']:5.0f} / {off['ssh']:5.0f}")
    big, small = max(sizes), min(sizes)
    on_big, off_big = results[(big, "on")], results[(big, "off")]
    return [
        Figure(f"bytes out at {big} hosts relayed, x one copy", on_big["out_mb"] / copy_mb, "x",
               f"--relay off {off_big['out_mb'] / copy_mb:.2f}x", GOAL_BYTES, higher_is_better=False),
        Figure(f"time until every node is ready, {big} hosts / {small} relayed",
               on_big["ready_s"] / results[(small, "on")]["ready_s"], "x",
               f"--relay off {off_big['ready_s'] / results[(small, 'off')]['ready_s']:.2f}x", GOAL_TIME,
               higher_is_better=False),
    ]


if __name__ == "__main__":
    sys.exit(main())
