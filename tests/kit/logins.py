"""A second login on a cluster's hosts, for tests of shared hosts (docs/shared-hosts.md).

Another account (made once with useradd like the stock `ddp`, in the docker group, kept after teardown), with its
own home on every host, its own key in that home's authorized_keys, and its own local HOME (~/.ssh/config that
logs in as it, known_hosts, key) and state folder: a second person using the same hosts from their own machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from devcluster import Cluster
from devcluster.hostfs import ensure_user
from devcluster.sshd import keygen
from kit.orchestrate_kit import LAYER_CACHE_HOME, PATIENCE, REPO, run_to_end, spawn


@dataclass(frozen=True)
class Login:
    """A person on this machine: their HOME (ssh config and key) and the orchestrator's state folder."""

    name: str
    home: Path
    state: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "HOME": str(self.home), "XDG_STATE_HOME": str(self.state), "PYTHONPATH": str(REPO),
                "XDG_CACHE_HOME": str(LAYER_CACHE_HOME)}

    def orchestrate(self, *args: str, timeout: float = PATIENCE) -> subprocess.CompletedProcess[str]:
        res = run_to_end(list(args), self.env(), timeout)
        print(f"[{self.name}] $ orchestrate {' '.join(args)}\n--- rc={res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def start(self, *args: str) -> subprocess.Popen[str]:
        return spawn(list(args), self.env(), merge_stderr=True)


def first_login(cluster: Cluster, tmp: Path) -> Login:
    """The cluster's own login (`ddp`), with a state folder of its own."""
    return Login(cluster.user, cluster.home, tmp / "state-first")


def add_login(cluster: Cluster, name: str, tmp: Path) -> Login:
    """Make `name` an SSH login of every host of the cluster, with its own home and key."""
    entry = ensure_user(name)
    local = tmp / f"home-{name}"
    ssh = local / ".ssh"
    ssh.mkdir(mode=0o700, parents=True)
    pub = keygen(ssh / "id_ed25519", f"devcluster-{name}")
    for host in cluster.hosts:
        home = host.path(f"/home/{name}")
        (home / ".ssh").mkdir(mode=0o700, parents=True)
        (home / ".ssh" / "authorized_keys").write_text(pub + "\n")
        (home / ".ssh" / "authorized_keys").chmod(0o600)
        for p in (home, home / ".ssh", home / ".ssh" / "authorized_keys"):
            os.chown(p, entry.pw_uid, entry.pw_gid)
    shutil.copy(cluster.home / ".ssh" / "known_hosts", ssh / "known_hosts")
    config = (cluster.dir / "ssh_config").read_text()
    config = config.replace(f"  User {cluster.user}\n", f"  User {name}\n")
    config = config.replace(f"  IdentityFile {cluster.dir / 'id_ed25519'}\n", f"  IdentityFile {ssh / 'id_ed25519'}\n")
    config = config.replace(f"  UserKnownHostsFile {cluster.dir / 'known_hosts'}\n",
                            f"  UserKnownHostsFile {ssh / 'known_hosts'}\n")
    (ssh / "config").write_text(config)
    return Login(name, local, tmp / f"state-{name}")
