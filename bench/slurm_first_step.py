"""Time from the command to the first training step: `submit --nodes 2` (Slurm) beside `up --hosts FILE` on the
same 2 test hosts, alternated round by round so that both see the same machine load (docs/slurm.md).

    sudo .venv/bin/python bench/slurm_first_step.py [--rounds 5] [--image ddp-cifar:cpu]

Needs root, slurm-wlm, munge and the CPU image. One 2-host devcluster with Slurm is made (and removed); a warm-up
`up` puts the data on the hosts. Each round: `up` of a long CPU job (2 nodes, 1 simulated GPU each), timed from
its start to rank 0's `epoch 1 step 1` line on its stdout, then `kill --job`; then `submit` of the same job, timed
from its start to that line in the batch job's output file (polled every 0.1 s), with the time from sbatch's
return to the batch script's first line, then `kill --job`. The batch job runs the system's python3 with the
venv's packages (the nodes do not see /root), as tests/cluster/test_slurm_backend.py does.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kit.orchestrate_kit import serve_data  # noqa: E402

from devcluster import Cluster  # noqa: E402

STEP = "epoch 1 step 1 "
TRAIN = ["--model", "tiny", "--batch-size", "16", "--allow-unverified-data", "--log-every", "1", "--epochs", "50"]
TIMEOUT_S = 180


def wait_for_text(path: Path, text: str, since: float) -> float:
    """Seconds from `since` until `text` is in the file at `path` (polled every 0.1 s)."""
    while time.monotonic() - since < TIMEOUT_S:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.monotonic() - since
        time.sleep(0.1)
    raise SystemExit(f"error: no {text!r} in {path} after {TIMEOUT_S} s")


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--image", default="ddp-cifar:cpu")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slurm-first-step-"))
    atexit.register(shutil.rmtree, work, True)
    rows = []
    with Cluster.create(2, gpus=2, slurm=True, images=(args.image,)) as c, \
            serve_data(work / "served", c.gateway) as data:
        env = {**c.client_env(), "XDG_STATE_HOME": str(c.dir / "orch-state"),
               "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}"}
        job = ["--image", args.image, "--gpus-on-cpu", "--data-url", data.url, "--data-md5", data.md5]
        hosts = c.write_hosts_file(work / "hosts.txt")

        def orchestrate(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "orchestrate", *argv], env=env, cwd=c.dir, text=True,
                                  capture_output=True, timeout=TIMEOUT_S, check=True)

        def up(name: str) -> float:
            log = work / f"{name}.out"
            t0 = time.monotonic()
            with log.open("w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "orchestrate", "up", "--hosts", str(hosts), "--gpus",
                                         "1", "--job", name, *job, "--", *TRAIN], env=env, cwd=c.dir, stdout=out,
                                        stderr=subprocess.STDOUT)
            took = wait_for_text(log, STEP, t0)
            orchestrate("kill", "--job", name)
            proc.wait(timeout=TIMEOUT_S)
            return took

        def submit(name: str) -> tuple[float, float]:
            t0 = time.monotonic()
            job_id = orchestrate("submit", "--nodes", "2", "--gpus-per-node", "1", "--python", "/usr/bin/python3",
                                 "--output", f"{c.dir}/slurm-%j.out", "--job", name, *job, "--", *TRAIN).stdout.strip()
            queued = time.monotonic()
            out = c.dir / f"slurm-{job_id}.out"
            started = wait_for_text(out, f"slurm job {job_id}: up --hosts slurm", queued)
            took = wait_for_text(out, STEP, t0)
            orchestrate("kill", "--job", name)
            while any(f"JobState={state}" in subprocess.run(["scontrol", "show", "job", job_id], env=env, text=True,
                                                           capture_output=True, timeout=60).stdout
                      for state in ("RUNNING", "COMPLETING")):  # its nodes free for the next round
                time.sleep(0.5)
            return took, started

        print(f"warm-up (data to both hosts): {up('warm'):.1f} s", flush=True)
        for i in range(args.rounds):
            ours, (queued, started) = up(f"u{i}"), submit(f"s{i}")
            rows.append((i + 1, ours, queued, started))
            print(f"round {i + 1}: up {ours:.1f} s, submit {queued:.1f} s (batch script ran {started:.1f} s after "
                  "sbatch)", flush=True)
    print("\n| round | `up` | `submit` | the batch script ran after `sbatch` |\n|---|---|---|---|")
    for r, u, s, b in rows:
        print(f"| {r} | {u:.1f} s | {s:.1f} s | {b:.1f} s |")
    print(f"\nmedians: up {statistics.median(r[1] for r in rows):.1f} s, submit "
          f"{statistics.median(r[2] for r in rows):.1f} s; median of each round's difference "
          f"{statistics.median(r[2] - r[1] for r in rows):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
