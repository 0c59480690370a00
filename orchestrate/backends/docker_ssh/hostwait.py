"""The wait for hosts before a restart (Scheduler.await_hosts): each host asked over a fresh SSH login whether it and
its Docker daemon answer again, until every one does or the time plan/restarts.py allows has passed."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console

from orchestrate.backends.docker_ssh.hostboot import PROBE_TIMEOUT_S
from orchestrate.fanout import fan_out
from orchestrate.hosts import Host
from orchestrate.remote.ssh import Connection


def _answers(host: Host, accept_new_host_keys: bool) -> bool:
    """The host takes an SSH login and its Docker daemon answers."""
    try:
        conn = Connection.open(host, accept_new_host_keys, timeout=PROBE_TIMEOUT_S)
    except Exception:  # not back yet
        return False
    try:
        return conn.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=PROBE_TIMEOUT_S).rc == 0
    except Exception:  # sshd answers, the daemon not yet
        return False
    finally:
        conn.close()


def await_hosts(hosts: Sequence[Host], accept_new_host_keys: bool, console: Console, timeout: float) -> None:
    """Until every host answers over SSH and its Docker daemon does too, at most `timeout` (plan/restarts.py says
    how long); then the restart goes on either way (its preflight names a host that is still down)."""
    deadline = time.monotonic() + timeout
    waiting = list(hosts)
    while True:
        ok = fan_out("host check", waiting, lambda h: _answers(h, accept_new_host_keys), lambda h: h.label)
        waiting = [h for h, answered in zip(waiting, ok, strict=True) if not answered]
        if not waiting or time.monotonic() > deadline:
            return
        console.print(f"waiting for {', '.join(h.label for h in waiting)} to answer again (SSH and Docker), "
                      f"{deadline - time.monotonic():.0f} s left", markup=False, highlight=False)
        time.sleep(2.0)
