"""Two people on the same 2 stock test hosts (docs/shared-hosts.md): each SSH login has its own account, home and
key; both run `up` with the default job name at the same time. Real sshd, dockerd and torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit.logins import Login, add_login, first_login
from kit.orchestrate_kit import IMAGE, PATIENCE, SHARED_CORES, TRAIN, Data, job_containers, serve_data

from devcluster import Cluster

OWNER_UID = "ddp-cifar.owner-uid"


@pytest.fixture(scope="module")
def target(cluster_factory):  # type: ignore[no-untyped-def]
    """A fresh 2-host cluster (the second login's homes go away with it), seeded with the CPU image: what is tested
    is two logins' jobs side by side, not two image transfers at once."""
    return cluster_factory(2, fresh=True, seeded=True)


def default_up(hosts: Path, data: Data, *extra: str, epochs: str = "1") -> list[str]:
    """`up` with the default job name (no --job)."""
    return ["up", "--hosts", str(hosts), "--gpus", "0", "--image", IMAGE, "--data-url", data.url,
            "--data-md5", data.md5, "--grace", "30", *SHARED_CORES, *extra, "--", *TRAIN, "--epochs", epochs]


def owned(cluster: Cluster, login: Login) -> dict[str, tuple[str, str]]:
    """{container id: (name, status)} of job `cifar` that the login owns, on every host."""
    uid = str(__import__("pwd").getpwnam(login.name).pw_uid)
    return {c.id: (c.name, c.status) for _, c in job_containers(cluster, "cifar")  # type: ignore[attr-defined]
            if c.labels.get(OWNER_UID) == uid}  # type: ignore[attr-defined]


def test_two_logins_share_hosts(target: Cluster, tmp_path: Path) -> None:
    alice, bob = first_login(target, tmp_path), add_login(target, "ddp2", tmp_path)
    hosts = target.write_hosts_file(tmp_path / "hosts.txt")
    with serve_data(tmp_path / "served", target.gateway) as data:
        runs = [alice.start(*default_up(hosts, data)), bob.start(*default_up(hosts, data))]  # no --master-port
        outs = [p.communicate(timeout=PATIENCE)[0] for p in runs]
        for login, p, out in zip((alice, bob), runs, outs, strict=True):
            print(f"[{login.name}] up rc={p.returncode}\n{out}")
        assert [p.returncode for p in runs] == [0, 0]
        assert all("finished: epochs=1" in out for out in outs)
        # Each node 0 got its own port without one given (the second to claim 29500 chose again).
        ports = {out.split("started: 2 node(s), master ", 1)[1].split()[0] for out in outs}
        assert len(ports) == 2, ports

        # Bob's job runs on; Alice's kill and --replace must leave it alone.
        assert bob.orchestrate(*default_up(hosts, data, "--detach", "--replace", epochs="40")).returncode == 0
        bobs = owned(target, bob)
        assert len(bobs) == 2 and {s for _, s in bobs.values()} == {"running"}
        assert len(owned(target, alice)) == 2  # her finished job's containers stay until she removes them

        killed = alice.orchestrate("kill", "--hosts", str(hosts))
        assert killed.returncode == 0 and owned(target, alice) == {} and owned(target, bob) == bobs
        again = alice.orchestrate("kill", "--hosts", str(hosts))
        assert again.returncode == 1 and "belongs to ddp2 (uid" in again.stderr
        assert owned(target, bob) == bobs

        replaced = alice.orchestrate(*default_up(hosts, data, "--detach", "--replace", epochs="40"))
        assert replaced.returncode == 0 and owned(target, bob) == bobs and len(owned(target, alice)) == 2

        mine = alice.orchestrate("status", "--hosts", str(hosts))
        assert mine.returncode == 0 and "-ddp2" not in mine.stdout and "cifar-node0-ddp" in mine.stdout
        everyone = alice.orchestrate("status", "--all", "--hosts", str(hosts))
        assert everyone.returncode == 0
        rows = [ln for ln in everyone.stdout.splitlines() if "cifar" in ln]
        assert any("ddp (uid" in r for r in rows) and any("ddp2 (uid" in r for r in rows)
        assert all("2/2" in r for r in rows), everyone.stdout

        for login in (alice, bob):
            assert login.orchestrate("kill", "--hosts", str(hosts)).returncode == 0
        assert job_containers(target, "cifar") == []
