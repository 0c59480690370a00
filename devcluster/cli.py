"""`python -m devcluster up|down|gc|ls`: make, remove and list simulated clusters."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, NoReturn

from .bench import bench
from .cluster import GPUS_ON_CPU_ENV, Cluster
from .errors import DevclusterError
from .gc import gc, owner_alive
from .layout import known_states


def cmd_up(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    c = Cluster.create(args.hosts, args.name, persistent=True, root_login=args.root_login,
                       no_sftp=args.no_sftp, shared=args.shared, gpus=args.gpus, slurm=args.slurm,
                       images=args.images)
    print(f"cluster {c.name}: {len(c.hosts)} hosts on {c.subnet} in {time.monotonic() - t0:.1f} s")
    if args.images:
        print(f"each host starts with {', '.join(args.images)} loaded (seed.py)")
    print(f"state folder: {c.dir}")
    print(f"login user: {c.user}" + (f"; {c.shared} is one folder on every host ({c.dir / 'shared'})"
                                     if c.shared else ""))
    for h in c.hosts:
        print(f"  {h.name}  {h.addr}  sftp {'on' if h.sftp else 'off'}  files {h.layout.fs_dir}  "
              f"DOCKER_HOST={h.docker_host}")
    if c.state.gpus:
        print(f"each host reports {c.state.gpus} simulated GPU(s) (nvidia-smi in /usr/games)")
    if c.slurm_conf:
        print(f"Slurm: partition `hosts` of {len(c.hosts)} nodes (their aliases)" + (
            f", gres gpu:{c.state.gpus} each" if c.state.gpus else "") + f"; SLURM_CONF={c.slurm_conf} sinfo")
    print(f"try: ssh -F {c.ssh_config} {c.hosts[0].name} docker info")
    told = f" {GPUS_ON_CPU_ENV}=1" if c.state.gpus else ""  # the hosts' GPUs are simulated: jobs run on CPU
    print(f"     HOME={c.home}{told} python -m orchestrate ... --hosts {c.hosts_file}")
    print(f"remove: python -m devcluster down --name {c.name}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    left = Cluster.load(args.name).close()
    if left:
        print(f"cluster {args.name}: could not remove: {'; '.join(left)}", file=sys.stderr)
        return 1
    print(f"cluster {args.name}: removed")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    removed = gc(all_=args.all)
    bad = {n: left for n, left in removed.items() if left}
    for name in removed:
        print(f"cluster {name}: removed" + (f"; left: {'; '.join(bad[name])}" if name in bad else ""))
    if not removed:
        print("nothing to remove")
    return 1 if bad else 0


def cmd_ls(args: argparse.Namespace) -> int:
    for s in known_states():
        owner = "persistent" if s.owner_pid is None else f"pid {s.owner_pid}" + (
            "" if owner_alive(s) else " (gone: gc removes it)")
        print(f"{s.name}  {s.n_hosts} hosts  {s.subnet}  {owner}  {s.dir}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    print(f"{'hosts':>5}  {'up (s)':>7}  {'down (s)':>8}   median of {args.reps}")
    for n, up, down in bench(tuple(args.sizes), args.reps):
        print(f"{n:>5}  {up:>7.2f}  {down:>8.2f}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad command line is one `error:` line and exit 2, like every other CLI of the project."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})  # no option taken by a prefix of its name

    def error(self, message: str) -> NoReturn:
        raise DevclusterError(f"{message} (see {self.prog} --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m devcluster", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create N hosts (kept until `down`)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--name", help="1-8 characters a-z0-9 (default: random)")
    up.add_argument("--root-login", action="store_true", help="log in as root instead of the non-root user ddp")
    up.add_argument("--no-sftp", type=int, nargs="+", default=[], metavar="I",
                    help="indices of hosts whose sshd has no sftp subsystem (e.g. --no-sftp 1)")
    up.add_argument("--shared", metavar="PATH",
                    help="one folder seen at PATH by every host, as an NFS mount (e.g. /mnt/shared)")
    up.add_argument("--gpus", type=int, default=0, metavar="N",
                    help="each host reports N GPUs through a simulated nvidia-smi (jobs hold those GPUs and run "
                         "on CPU: orchestrate is told with DEVCLUSTER_GPUS_ON_CPU=1)")
    up.add_argument("--slurm", action="store_true",
                    help="a real Slurm: slurmctld on this machine, slurmd on each host (GPUs as gres with --gpus)")
    up.add_argument("--images", nargs="+", default=[], metavar="IMAGE",
                    help="local images every host starts with, as if loaded there by hand (e.g. ddp-cifar:cpu; "
                         "made once per image build, then hard links: docs/devcluster.md, Seeded hosts)")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="remove one cluster")
    down.add_argument("--name", required=True)
    down.set_defaults(func=cmd_down)
    g = sub.add_parser("gc", help="remove clusters whose owner process is gone, and orphaned objects")
    g.add_argument("--all", action="store_true", help="also remove live and persistent clusters")
    g.set_defaults(func=cmd_gc)
    sub.add_parser("ls", help="list clusters").set_defaults(func=cmd_ls)
    b = sub.add_parser("bench", help="time up and down of 1, 2, 4 hosts")
    b.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    b.add_argument("--reps", type=int, default=3)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except DevclusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
