"""The labels every container of a job carries, and its owner: the contract between `up` and every later
command (`status`, `logs`, `kill`, `--replace`, `--resume`, the claims of shared hosts), read back from the hosts.

Owned jobs on shared hosts (docs/shared-hosts.md): every container carries its owner, the SSH login's uid and
name on that host; containers of older versions, which carry no owner label, count as the caller's (migration).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

JOB_LABEL = "ddp-cifar.job"
RANK_LABEL = "ddp-cifar.node-rank"
NNODES_LABEL = "ddp-cifar.nnodes"
VERSION_LABEL = "ddp-cifar.version"
RESTART_LABEL = "ddp-cifar.restart"  # the automatic restart this container belongs to (0: the first start)
RESTART_CAUSE_LABEL = "ddp-cifar.restart-cause"
GPUS_LABEL = "ddp-cifar.gpus"  # the device indices a container holds, "0,1" (absent: none); plan/gpuset.py
PORT_LABEL = "ddp-cifar.master-port"  # node 0's rendezvous port, on node 0's container only; plan/ports.py
PREFETCH_LABEL = "ddp-cifar.prefetch"  # the data fetch's container: the job it fetches for (`kill` removes it too)
# The file the data fetch leaves in a data folder it verified (holding the archive's md5): what the probe reads back.
DATA_MARKER = ".ddp-cifar-verified"
IMAGE_CHECK_LABEL = "ddp-cifar.image-check"  # the image check's container: the job it checks the image of
OWNER_LABEL = "ddp-cifar.owner"  # the login's name on the host
OWNER_UID_LABEL = "ddp-cifar.owner-uid"  # its uid there: the one that decides (names can be reused)
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def owner_labels(user: str | None, login: str | None) -> dict[str, str]:
    """PURE: the owner labels of a container run as `user` ("uid:gid", preflight's), none when not known yet
    (an offline dry run)."""
    if user is None:
        return {}
    return {OWNER_UID_LABEL: user.split(":", 1)[0], OWNER_LABEL: login or ""}


def is_mine(labels: Mapping[str, str], uid: int) -> bool:
    """PURE: whether a container belongs to the login `uid`; one without an owner label (an older version's)
    does."""
    owner = labels.get(OWNER_UID_LABEL)
    return owner is None or owner == str(uid)


def owner_text(labels: Mapping[str, str]) -> str:
    """PURE: who owns a container, for one line: `bob (uid 1001)`."""
    uid = labels.get(OWNER_UID_LABEL)
    if uid is None:
        return "an older version (no owner label)"
    return f"{labels.get(OWNER_LABEL) or '?'} (uid {uid})"


def container_name(job: str, rank: int, login: str | None) -> str:
    """PURE: the container's name; with the login in it, two people's jobs of the same name do not clash
    (a name is unique per Docker daemon)."""
    if not login:
        return f"{job}-node{rank}"
    return f"{job}-node{rank}-{_NAME_UNSAFE.sub('_', login)}"
