"""Launch latency: command to exit for a 1-step job on 1, 2 and 4 test hosts (image and data present), beside
DeepSpeed's launcher (pdsh) running a trivial gloo all_reduce on the same hosts, interleaved in one run.

    sudo .venv/bin/python bench/launch_latency.py [--repeats 3] [--image ddp-cifar:cpu]

Needs root, the local dockerd, the CPU image, Debian's `pdsh`, and a bench venv with DeepSpeed made from the
system's Python (pdsh runs it on the hosts as their non-root login, who cannot enter /root, where pyenv lives):
    /usr/bin/python3 -m venv .venv-bench-ds && .venv-bench-ds/bin/pip install torch==2.13.0 deepspeed
One 4-host devcluster is made (and removed). A warm-up `up` moves the image and the data. `up` does its
preflight, image and data checks, starts one container per host, trains 1 step and waits for every exit;
DeepSpeed (DS_ACCELERATOR=cpu, GLOO_SOCKET_IFNAME through .deepspeed_env, --no_ssh_check) starts one process per
host that joins gloo, all_reduces one tensor and exits. `up` also runs that very program (`--entry`, from an
image made FROM the CPU image with the script added): the launchers compared on the same work. Prints median
seconds and the ratios up / DeepSpeed; exits 1 when `up` of the 1-step trainer job on 2 hosts takes more than
GOAL_RATIO times DeepSpeed's launcher (bench/bounds.py).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from bounds import Figure, finish  # noqa: E402
from kit.orchestrate_kit import host_dirs, serve_data  # noqa: E402

from devcluster import Cluster  # noqa: E402

ALL_REDUCE_IMAGE = "ddp-cifar-allreduce:bench"
DS_PYTHON = REPO / ".venv-bench-ds" / "bin" / "python"
GOAL_RATIO = 1.0  # the goal: `up` on 2 hosts at most as long as DeepSpeed's launcher
TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--max-steps", "1"]
ALL_REDUCE = """import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
print("DONE", dist.get_rank(), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's threads outlive the group: SIGABRT at finalization otherwise (trainer/__main__.py)
"""


def build_all_reduce_image(base: str, folder: Path) -> None:
    """The CPU image plus /app/allreduce.py: one small layer, which the warm-up sends as a layer delta."""
    folder.mkdir()
    (folder / "allreduce.py").write_text(ALL_REDUCE)
    (folder / "Dockerfile").write_text(f"FROM {base}\nCOPY allreduce.py /app/allreduce.py\n")
    docker.from_env().images.build(path=str(folder), tag=ALL_REDUCE_IMAGE, rm=True)


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    t0 = time.monotonic()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({res.returncode}):\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}")
    return took, res.stdout


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image", default="ddp-cifar:cpu")
    args = parser.parse_args()
    if not DS_PYTHON.exists() or DS_PYTHON.resolve().is_relative_to("/root"):
        raise SystemExit(f"error: {DS_PYTHON} missing or made from a Python under /root: /usr/bin/python3 -m venv "
                         ".venv-bench-ds && .venv-bench-ds/bin/pip install torch==2.13.0 deepspeed")
    work = Path(tempfile.mkdtemp(prefix="launch-latency-"))
    # DeepSpeed's runner starts the script in its own cwd on every host: a folder the hosts share with this
    # machine (each host has its own /tmp) and their login can read.
    (REPO / ".cache").mkdir(exist_ok=True)
    ds_dir = Path(tempfile.mkdtemp(prefix="launch-latency-ds-", dir=REPO / ".cache"))
    ds_dir.chmod(0o755)
    for folder in (work, ds_dir):  # removed however the bench ends (an error in a run included)
        atexit.register(shutil.rmtree, folder, True)
    (ds_dir / "allreduce.py").write_text(ALL_REDUCE)
    (ds_dir / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\nDS_ACCELERATOR=cpu\n")
    rows = []
    with Cluster.create(4) as cluster, serve_data(work / "served", cluster.gateway) as data:
        env = {**cluster.client_env(), "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(work / "state")}
        # pdsh runs OpenSSH, which reads ~/.ssh from the account entry: give it the cluster's config.
        ds_env = {**env, "DS_ACCELERATOR": "cpu", "PDSH_RCMD_TYPE": "ssh",
                  "PDSH_SSH_ARGS": f"-F {cluster.ssh_config} -x %h", "PYTHONPATH": ""}

        def up(n: int, job: str, same_program: bool = False) -> float:
            hosts = cluster.write_hosts_file(work / f"hosts{n}.txt", keys=host_dirs(work, 4),
                                             hosts=cluster.hosts[:n])
            what = (["--image", ALL_REDUCE_IMAGE, "--entry", "/app/allreduce.py"] if same_program else
                    ["--image", args.image, "--data-url", data.url, "--data-md5", data.md5, "--", *TRAIN])
            took, out = timed([sys.executable, "-m", "orchestrate", "up", "--timings", "--hosts", str(hosts), "--job",
                               job, "--gpus", "0", *what], env, REPO)
            print(f"  {job}: {next(ln for ln in out.splitlines() if ln.startswith('timings'))}", flush=True)
            return took

        def deepspeed(n: int) -> float:
            hostfile = ds_dir / f"hostfile{n}"
            hostfile.write_text("".join(f"{h.name} slots=1\n" for h in cluster.hosts[:n]))
            return timed([str(DS_PYTHON), "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
                          "--launcher", "pdsh", "--no_ssh_check", "--force_multi", "--master_addr", cluster.hosts[0].addr,
                          "--master_port", "29610", "--num_gpus", "1", "allreduce.py"], ds_env, ds_dir)[0]

        build_all_reduce_image(args.image, work / "image")
        print(f"warm-up (image + data to 4 hosts): {up(4, 'warm'):.1f} s", flush=True)
        print(f"warm-up (the all_reduce image's layer): {up(4, 'warm-ar', same_program=True):.1f} s", flush=True)
        for n in (1, 2, 4):
            ours, same, theirs = [], [], []
            for i in range(args.repeats):  # interleaved: all see the same machine load
                ours.append(up(n, f"lat{n}-{i}"))
                same.append(up(n, f"ar{n}-{i}", same_program=True))
                theirs.append(deepspeed(n))
            rows.append((n, statistics.median(ours), statistics.median(same), statistics.median(theirs)))
            print(f"{n} host(s): up {ours}, up all_reduce {same}, deepspeed {theirs}", flush=True)
    print("\n| hosts | `up` 1-step job | `up` trivial all_reduce | DeepSpeed launcher, trivial all_reduce "
          "| 1-step job / DeepSpeed | same program / DeepSpeed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, ours_s, same_s, ds_s in rows:
        print(f"| {n} | {ours_s:.2f} s | {same_s:.2f} s | {ds_s:.2f} s | {ours_s / ds_s:.2f}x | {same_s / ds_s:.2f}x |")
    print(f"\nmedian of {args.repeats}; {os.cpu_count()} CPU cores shared")
    return finish([Figure(f"{n} hosts: `up` of a 1-step trainer job / DeepSpeed's launcher", ours_s / ds_s, "x",
                          f"DeepSpeed's launcher, all_reduce {ds_s:.2f} s (ours {ours_s:.2f} s)", GOAL_RATIO, False)
                   for n, ours_s, _, ds_s in rows if n == 2])


if __name__ == "__main__":
    sys.exit(main())
