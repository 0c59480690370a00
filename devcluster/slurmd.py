"""A real Slurm on the simulated hosts (`up --slurm`): munged, slurmctld on the machine, one slurmd per host.

As on a real site, every node runs munged and slurmd, and the controller runs elsewhere:
- munged: one for the machine at Slurm's default socket (/run/munge/munge.socket.2), for slurmctld and the
  clients (sinfo, srun, sbatch); it is a service of the machine like its dockerd, kept after teardown (other
  clusters may use it). Each host has its own /run (hostfs), so each host runs its own munged there, with the
  machine's key (/etc/munge/munge.key; /etc is shared), as every node of a real site does.
- slurmctld: in the root namespace, `SlurmctldHost=<machine's hostname>(<the cluster's gateway address>)`, its
  port the cluster's own (two clusters' controllers share the machine's network), its state, pid and log files
  under `<cluster>/slurm/`.
- slurmd: in the host's network and mount namespaces and a UTS namespace of its own whose hostname is the host's
  alias: that is how slurmd finds its NodeName (`slurmd -N` needs a build with multiple-slurmd). Each one is in
  its own netns, so Slurm's default SlurmdPort serves them all.
No cgroups (the hosts share the machine's cgroup tree): proctrack/linuxproc, task/none, and no accounting.
"""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from .errors import StartError
from .hostfs import in_host
from .layout import ClusterState, HostLayout, state_lock
from .proc import (
    alive,
    cmdline,
    pids_in_netns,
    pids_matching,
    run,
    socket_answers,
    spawn,
    stop_pids,
    wait_until,
)

TOOLS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")
PACKAGES = "slurm-wlm munge"  # Debian's, as scripts/setup.sh installs them
MUNGE_USER = "munge"
MUNGE_DIR = Path("/run/munge")  # Slurm's and munge's default socket folder, on the machine and on each host
MUNGE_SOCKET = "munge.socket.2"
# The controller's port: one per cluster (subnet index 1..254), off Slurm's defaults (6817, 6818) so that a site's
# own Slurm on this machine is never hit.
CTLD_PORT_BASE = 16900
START_TIMEOUT = 60.0
NODE_CONF = "/run/slurm/conf/slurm.conf"  # a host's own copy, as the host sees it (node_conf_dir)


def slurm_dir(state: ClusterState) -> Path:
    """Everything Slurm writes for the cluster: slurm.conf, gres.conf, the controller's state and logs, and a
    folder per node (spool, pid, log). Every Slurm daemon of the cluster names it on its command line."""
    return state.dir / "slurm"


def slurm_conf(state: ClusterState) -> Path:
    return slurm_dir(state) / "slurm.conf"


def ctld_port(state: ClusterState) -> int:
    return CTLD_PORT_BASE + state.subnet_index


def gpu_files(state: ClusterState) -> list[Path]:
    """Stand-ins for /dev/nvidia0..N-1 that gres.conf names: links to /dev/null, since slurmd accepts only a
    character or block device; without cgroups it only reads the GPU's index from the file's number."""
    return [slurm_dir(state) / "dev" / f"nvidia{i}" for i in range(state.gpus)]


def hardware() -> str:
    """This machine's node line as `slurmd -C` prints it (CPUs=.. Boards=.. RealMemory=..), less its NodeName: what
    a site writes into slurm.conf for each node. Every simulated host has the machine's CPUs and memory."""
    first = run(["slurmd", "-C"], timeout=30).stdout.splitlines()[0]
    return " ".join(w for w in first.split() if not w.startswith("NodeName="))


def slurm_conf_text(state: ClusterState, hostname: str, hw: str) -> str:
    d = slurm_dir(state)
    gres = f" Gres=gpu:{state.gpus}" if state.gpus else ""
    lines = [
        f"ClusterName=dc{state.name}",
        f"SlurmctldHost={hostname}({state.gateway})",
        f"SlurmctldPort={ctld_port(state)}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"StateSaveLocation={d / 'ctld'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdSpoolDir={d / '%n' / 'spool'}",
        f"SlurmdPidFile={d / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={d / '%n' / 'slurmd.log'}",
        # no cgroups: the simulated hosts share the machine's cgroup tree
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",  # what --gpus-per-node needs
        "MpiDefault=none",
        "MailProg=/bin/true",  # no mail on the test machine
        "ReturnToService=2",  # a host back from a reboot() serves again
        *(["GresTypes=gpu"] if state.gpus else []),
        *(f"NodeName={h.alias} NodeAddr={h.addr} {hw}{gres} State=UNKNOWN" for h in state.hosts()),
        "PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def gres_conf_text(state: ClusterState) -> str:
    files = gpu_files(state)
    return "".join(f"NodeName={h.alias} Name=gpu File={f}\n" for h in state.hosts() for f in files)


def node_conf_dir(host: HostLayout) -> Path:
    """The host's /run/slurm/conf as this machine sees it: where Slurm's clients look for slurm.conf when
    neither SLURM_CONF nor /etc/slurm/slurm.conf exists (a configless node's cache). So on a host, slurmd, its
    jobs and anyone who logs in find the cluster's Slurm as on a site's node, whatever their user (the copy
    under the cluster's folder is root's only, as that folder is)."""
    return host.fs_dir / "run" / "slurm" / "conf"


def write_conf(state: ClusterState) -> None:
    d = slurm_dir(state)
    for sub in (d / "ctld", d / "dev", *(d / h.alias / "spool" for h in state.hosts())):
        sub.mkdir(mode=0o755, parents=True, exist_ok=True)
    for f in gpu_files(state):
        f.symlink_to("/dev/null")
    files = {"slurm.conf": slurm_conf_text(state, socket.gethostname().split(".")[0], hardware()),
             "gres.conf": gres_conf_text(state)}  # slurmd reads gres.conf beside its slurm.conf
    for folder in (d, *(node_conf_dir(h) for h in state.hosts())):
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
            (folder / name).chmod(0o644)


# --- munge ---------------------------------------------------------------------------------------------------


def _munged_argv(run_dir: str, *, foreground: bool) -> list[str]:
    """munged as the munge user, its socket, pid, log and seed in run_dir (as that munged sees it)."""
    entry = pwd.getpwnam(MUNGE_USER)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--",
            "munged", *(["--foreground"] if foreground else []), f"--socket={run_dir}/{MUNGE_SOCKET}",
            f"--pid-file={run_dir}/munged.pid", f"--log-file={run_dir}/munged.log",
            f"--seed-file={run_dir}/munged.seed"]


def _munge_dir(path: Path) -> None:
    """The socket folder, owned by munge and not writable by others, as munged demands."""
    entry = pwd.getpwnam(MUNGE_USER)
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o755)


def ensure_machine_munged() -> None:
    """The machine's munged, started once if none answers (under the state lock: two test sessions start at
    once). munged forks once its socket is bound, so a zero exit means it answers."""
    with state_lock():
        if socket_answers(MUNGE_DIR / MUNGE_SOCKET):
            return
        _munge_dir(MUNGE_DIR)
        run(_munged_argv(str(MUNGE_DIR), foreground=False), timeout=30)


def _host_munge_dir(host: HostLayout) -> Path:
    """The host's /run/munge as this machine sees it."""
    return host.fs_dir / "run" / "munge"


def spawn_munged(host: HostLayout) -> int:
    _munge_dir(_host_munge_dir(host))
    p = spawn(in_host(host, _munged_argv(str(MUNGE_DIR), foreground=True)), host.log_dir / "munged.out")
    return p.pid


# --- slurmctld and slurmd ------------------------------------------------------------------------------------


def spawn_slurmctld(state: ClusterState) -> int:
    p = spawn(["slurmctld", "-D", "-f", str(slurm_conf(state))], slurm_dir(state) / "slurmctld.out")
    return p.pid


def spawn_slurmd(state: ClusterState, host: HostLayout) -> int:
    """slurmd in the host's namespaces, in a UTS namespace whose hostname is the host's alias (its NodeName), on
    the node's own copy of slurm.conf (its jobs get that path as SLURM_CONF). unshare and sh exec, so the pid is
    slurmd's."""
    script = f'hostname "$1" && exec slurmd -D -f {NODE_CONF}'
    argv = in_host(host, ["unshare", "--uts", "sh", "-c", script, "sh", host.alias])
    return spawn(argv, slurm_dir(state) / host.alias / "slurmd.out").pid


def _exited(pid: int, logs: Sequence[Path]) -> str | None:
    if alive(pid):
        return None
    tails = [f"{log}: {' | '.join(log.read_text(errors='replace').strip().splitlines()[-3:])}"
             for log in logs if log.exists() and log.stat().st_size]
    return f"exited; last log lines: {'; '.join(tails) or 'none'}"


def _wait(pred: Callable[[], bool], what: str, pid: int, *logs: Path) -> None:
    """Until pred holds; fails early with the logs' last lines if the daemon (pid) exits."""
    try:
        wait_until(pred, START_TIMEOUT, what, lambda: _exited(pid, logs))
    except Exception as e:
        raise StartError(str(e)) from e


def slurm_env(state: ClusterState) -> dict[str, str]:
    """What a Slurm client (sinfo, srun, sbatch, scontrol) needs to reach this cluster's controller."""
    return {**os.environ, "SLURM_CONF": str(slurm_conf(state))}


def _ctld_answers(state: ClusterState) -> bool:
    res = run(["scontrol", "ping"], check=False, timeout=10, env=slurm_env(state))
    return "is UP" in res.stdout


def _nodes_idle(state: ClusterState) -> bool:
    res = run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10, env=slurm_env(state))
    states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
    return all(states.get(h.alias) == "idle" for h in state.hosts())


def start_slurm(state: ClusterState) -> None:
    """munged (machine and hosts), slurmctld, then every slurmd; ready once sinfo shows every node idle."""
    write_conf(state)
    ensure_machine_munged()
    hosts = state.hosts()
    munged = {h.index: spawn_munged(h) for h in hosts}
    ctld = spawn_slurmctld(state)
    for h in hosts:
        _wait_munged(h, munged[h.index])
    d = slurm_dir(state)
    _wait(lambda: _ctld_answers(state), "slurmctld", ctld, d / "slurmctld.log", d / "slurmctld.out")
    slurmd = {h.index: spawn_slurmd(state, h) for h in hosts}
    for h in hosts:
        _wait_idle(state, h, slurmd[h.index])


def start_node(state: ClusterState, host: HostLayout) -> None:
    """The host's munged and slurmd again (after a reboot()): ready once the node is idle again."""
    _wait_munged(host, spawn_munged(host))
    _wait_idle(state, host, spawn_slurmd(state, host))


def _wait_munged(host: HostLayout, pid: int) -> None:
    sock = _host_munge_dir(host) / MUNGE_SOCKET
    _wait(partial(socket_answers, sock), f"munged of {host.alias}", pid, host.log_dir / "munged.out")


def _wait_idle(state: ClusterState, host: HostLayout, pid: int) -> None:
    d = slurm_dir(state) / host.alias
    _wait(lambda: _nodes_idle(state), f"slurmd of {host.alias} (idle in sinfo)", pid, d / "slurmd.log", d / "slurmd.out")


def stop_slurm(state: ClusterState) -> None:
    """slurmctld (it names the cluster's slurm.conf) and each host's slurmd (in the host's netns); munged and the
    jobs go with the rest of the hosts' processes (teardown's leftovers)."""
    slurmds = [p for h in state.hosts() for p in pids_in_netns(h.netns) if cmdline(p).startswith("slurmd ")]
    pids = pids_matching(str(slurm_dir(state)) + "/") + slurmds
    if pids:
        stop_pids(pids, grace=10)
