"""Launch latency: `up` against DeepSpeed's launcher (pdsh) running the same trivial program (a gloo all_reduce)
on 2, 4, 8 and 16 test hosts, the launching side pinned to core 0 and the hosts to core 1, interleaved in one run.

    sudo .venv/bin/python bench/launch_latency.py [--sizes 2 4 8 16] [--repeats 3] [--trainer-job]

Needs root, the local dockerd, the CPU image, Debian's `pdsh`, and a bench venv with DeepSpeed made from the
system's Python (pdsh runs it on the hosts as their non-root login, who cannot enter /root, where pyenv lives):
    /usr/bin/python3 -m venv .venv-bench-ds && .venv-bench-ds/bin/pip install torch==2.13.0 deepspeed
(DS_VENV moves it). One devcluster of the largest size is made (and removed), its hosts seeded with the CPU image
(the image is not the subject); a warm-up `up` sends the all_reduce image's one small layer. DeepSpeed
(DS_ACCELERATOR=cpu, GLOO_SOCKET_IFNAME through .deepspeed_env, --no_ssh_check) starts one process per host that
joins gloo, all_reduces one tensor and exits; `up` runs that very program (`--entry`, from an image made FROM the
CPU image with the script added): the launchers compared on the same work. `up` does its preflight and image checks,
starts one container per host and waits for every exit. `--trainer-job` adds `up` of a 1-step trainer job.

Pinning (2 cores): both launchers (`up`, DeepSpeed's runner and its pdsh/ssh children) run under `taskset -c 0`;
every process of every host (its sshd, containerd, dockerd, and so what they start later: sshd sessions, shims,
containers, DeepSpeed's remote processes) is pinned to core 1, all threads. The program prints the cores it ran
on, and the bench checks them. The machine's other load is not pinned: it prints the load average.

Prints median seconds and the ratio up / DeepSpeed per size; exits 1 when the ratio at the largest size is past
GOAL_RATIO or rose from the smallest size to the largest (bench/bounds.py).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
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
from devcluster.proc import pids_in_netns  # noqa: E402

ALL_REDUCE_IMAGE = "ddp-cifar-allreduce:bench"
DS_PYTHON = Path(os.environ.get("DS_VENV", REPO / ".venv-bench-ds")) / "bin" / "python"
GOAL_RATIO = 0.6  # the goal: `up` of the same program at most 0.6x DeepSpeed's launcher at 16 hosts
GOAL_TRAINER_RATIO = 1.0  # `up` of a 1-step trainer job at most as long as DeepSpeed's trivial program, 2 hosts
LAUNCHER_CORE, HOSTS_CORE = 0, 1
TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--max-steps", "1"]
ALL_REDUCE = """import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
print("DONE", dist.get_rank(), "cores", sorted(os.sched_getaffinity(0)), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's threads outlive the group: SIGABRT at finalization otherwise (trainer/__main__.py)
"""
PINNED = ["taskset", "-c", str(LAUNCHER_CORE)]


def build_all_reduce_image(base: str, folder: Path) -> None:
    """The CPU image plus /app/allreduce.py: one small layer, which the warm-up sends as a layer delta."""
    folder.mkdir()
    (folder / "allreduce.py").write_text(ALL_REDUCE)
    (folder / "Dockerfile").write_text(f"FROM {base}\nCOPY allreduce.py /app/allreduce.py\n")
    docker.from_env().images.build(path=str(folder), tag=ALL_REDUCE_IMAGE, rm=True)


def pin_hosts(cluster: Cluster) -> int:
    """Every thread of every process of the hosts onto HOSTS_CORE; what they start later inherits it. The count."""
    count = 0
    for host in cluster.hosts:
        for pid in pids_in_netns(host.netns):
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), {HOSTS_CORE})
                    count += 1
                except (ProcessLookupError, FileNotFoundError):
                    pass  # ended meanwhile
    return count


def check_cores(out: str, n: int, who: str) -> None:
    """Each rank printed the cores it ran on: all on HOSTS_CORE, or the pinning did not reach it."""
    cores = re.findall(r"DONE (\d+) cores (\[[\d, ]*\])", out)
    if len(cores) != n or any(c != f"[{HOSTS_CORE}]" for _, c in cores):
        raise SystemExit(f"{who} on {n} hosts: ranks' cores {cores}, expected {n} ranks on [{HOSTS_CORE}]")


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    t0 = time.monotonic()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{argv[:5]} failed ({res.returncode}):\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}")
    return took, res.stdout + res.stderr


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image", default="ddp-cifar:cpu")
    parser.add_argument("--trainer-job", action="store_true", help="also time `up` of a 1-step trainer job")
    args = parser.parse_args()
    if not DS_PYTHON.exists() or DS_PYTHON.resolve().is_relative_to("/root"):
        raise SystemExit(f"error: {DS_PYTHON} missing or made from a Python under /root: /usr/bin/python3 -m venv "
                         ".venv-bench-ds && .venv-bench-ds/bin/pip install torch==2.13.0 deepspeed")
    if os.cpu_count() is None or os.cpu_count() < 2:  # type: ignore[operator]
        raise SystemExit("error: the pinning needs 2 cores (launcher on core 0, hosts on core 1)")
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
    largest = max(args.sizes)
    rows = []
    build_all_reduce_image(args.image, work / "image")
    with Cluster.create(largest, images=[args.image]) as cluster, \
            serve_data(work / "served", cluster.gateway) as data:
        env = {**cluster.client_env(), "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(work / "state")}
        # pdsh runs OpenSSH, which reads ~/.ssh from the account entry: give it the cluster's config.
        ds_env = {**env, "DS_ACCELERATOR": "cpu", "PDSH_RCMD_TYPE": "ssh",
                  "PDSH_SSH_ARGS": f"-F {cluster.ssh_config} -x %h", "PYTHONPATH": ""}

        def up(n: int, job: str, same_program: bool = True) -> float:
            hosts = cluster.write_hosts_file(work / f"hosts{n}.txt", keys=host_dirs(work, largest),
                                             hosts=cluster.hosts[:n])
            what = (["--image", ALL_REDUCE_IMAGE, "--entry", "/app/allreduce.py"] if same_program else
                    ["--image", args.image, "--data-url", data.url, "--data-md5", data.md5, "--", *TRAIN])
            took, out = timed([*PINNED, sys.executable, "-m", "orchestrate", "up", "--timings", "--hosts", str(hosts),
                               "--job", job, "--gpus", "0", *what], env, REPO)
            if same_program:
                check_cores(out, n, "`up`")
            print(f"  {job} {took:.2f} s: {next(ln for ln in out.splitlines() if ln.startswith('timings'))}",
                  flush=True)
            return took

        def deepspeed(n: int) -> float:
            hostfile = ds_dir / f"hostfile{n}"
            hostfile.write_text("".join(f"{h.name} slots=1\n" for h in cluster.hosts[:n]))
            took, out = timed([*PINNED, str(DS_PYTHON), "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
                               "--launcher", "pdsh", "--no_ssh_check", "--force_multi", "--master_addr",
                               cluster.hosts[0].addr, "--master_port", "29610", "--num_gpus", "1", "allreduce.py"],
                              ds_env, ds_dir)
            check_cores(out, n, "DeepSpeed")
            print(f"  deepspeed {n} hosts {took:.2f} s", flush=True)
            return took

        print(f"pinned {pin_hosts(cluster)} threads of {largest} hosts to core {HOSTS_CORE}", flush=True)
        print(f"warm-up (the all_reduce image's layer): {up(largest, 'warm-ar'):.1f} s", flush=True)
        if args.trainer_job:
            print(f"warm-up (data): {up(largest, 'warm', same_program=False):.1f} s", flush=True)
        for n in args.sizes:
            ours, same, theirs = [], [], []
            for i in range(args.repeats):  # interleaved: all see the same machine load
                pin_hosts(cluster)  # a process a host started unpinned (none expected) is pinned before each run
                same.append(up(n, f"ar{n}-{i}"))
                theirs.append(deepspeed(n))
                if args.trainer_job:
                    ours.append(up(n, f"lat{n}-{i}", same_program=False))
            rows.append((n, statistics.median(same), statistics.median(theirs),
                         statistics.median(ours) if ours else None))
            print(f"{n} host(s): up {same}, deepspeed {theirs}" + (f", up 1-step job {ours}" if ours else "")
                  + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    print("\n| hosts | `up`, trivial all_reduce | DeepSpeed launcher, trivial all_reduce | up / DeepSpeed "
          "| `up` 1-step trainer job / DeepSpeed |")
    print("|---:|---:|---:|---:|---:|")
    for n, same_s, ds_s, ours_s in rows:
        trainer = f"{ours_s / ds_s:.2f}x ({ours_s:.2f} s)" if ours_s is not None else "-"
        print(f"| {n} | {same_s:.2f} s | {ds_s:.2f} s | {same_s / ds_s:.2f}x | {trainer} |")
    print(f"\nmedian of {args.repeats}; launchers on core {LAUNCHER_CORE}, hosts on core {HOSTS_CORE} "
          f"({os.cpu_count()} cores, shared with the machine's other load)")
    return finish(figures(rows))


def figures(rows: list[tuple[int, float, float, float | None]]) -> list[Figure]:
    """The ratio at the largest size against GOAL_RATIO; the largest size's ratio over the smallest's at most 1 (not
    rising with hosts); the 1-step trainer job at 2 hosts against DeepSpeed's trivial program, where measured."""
    (n0, same0, ds0, _), (n1, same1, ds1, _) = rows[0], rows[-1]
    out = [Figure(f"{n1} hosts: `up` / DeepSpeed's launcher, the same trivial program", same1 / ds1, "x",
                  f"DeepSpeed's launcher {ds1:.2f} s (`up` {same1:.2f} s)", GOAL_RATIO, False)]
    if n1 > n0:
        out.append(Figure(f"that ratio at {n1} hosts / at {n0}", (same1 / ds1) / (same0 / ds0), "x",
                          f"{n0} hosts: {same0 / ds0:.2f}x", 1.0, False))
    out += [Figure(f"{n} hosts: `up` of a 1-step trainer job / DeepSpeed's launcher", ours_s / ds_s, "x",
                   f"DeepSpeed's launcher, all_reduce {ds_s:.2f} s (ours {ours_s:.2f} s)", GOAL_TRAINER_RATIO, False)
            for n, _, ds_s, ours_s in rows if n == 2 and ours_s is not None]
    return out


if __name__ == "__main__":
    sys.exit(main())
