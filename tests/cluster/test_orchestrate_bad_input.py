"""Refusals on real test hosts: each is one line per affected host, a non-zero exit, and nothing started.

Continues the table in tests/orchestrate/test_bad_input.py (cases 1-30 need no host):

| #  | input                                                   | the line says                                             |
|----|---------------------------------------------------------|-----------------------------------------------------------|
| 31 | unknown host key                                        | host key of H (...) is unknown: not in FILE; ssh-keyscan  |
| 32 | changed host key                                        | host key of H CHANGED ...; remove the old key at FILE:LINE|
| 33 | wrong SSH key                                           | cannot log in to H ...: authentication failed             |
| 34 | connection refused                                      | connection to H (...) refused; is sshd running ...        |
| 35 | unresolvable host                                       | host name 'x.invalid' of x.invalid does not resolve       |
| 36 | --gpus 1 on hosts without GPUs                          | H: gpus: nvidia-smi not found ...; or use --gpus 0        |
| 37 | master port in use on node 0                            | H0: port: master port P already in use on node 0          |
| 38 | a node without Docker                                   | H1: docker: cannot reach the Docker daemon over SSH       |
| 39 | image missing here and on the nodes, no --pull          | H: image: X missing here and on this machine; ... --pull  |
| 40 | data dir that cannot be created (a file in its path)    | H: disk: data dir D cannot be created: F is not a dir...  |
| 41 | checkpoint dir on a (too) full disk                     | H: disk: data dir D: 57 GB free, 1000000 GB needed        |
| 42 | data archive with a wrong md5                           | H: data prefetch ... md5 of URL is X, expected Y          |
| 43 | `up --resume` with no checkpoint                        | (tests/cluster/test_orchestrate_up.py)                    |
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kit.lines import LineReader
from kit.orchestrate_kit import Data, job_containers, orchestrate, up_args

from devcluster import Cluster
from devcluster.proc import in_netns

pytestmark = [pytest.mark.cluster, pytest.mark.docker]


@pytest.fixture
def hosts(cluster: Cluster) -> Path:
    return cluster.hosts_file  # the default dirs: per user, under each host's own home


def ssh_config_with(cluster: Cluster, tmp_path: Path, **replace: str) -> Path:
    """A copy of the cluster's ssh config with UserKnownHostsFile / IdentityFile replaced."""
    text = Path(cluster.ssh_config).read_text()
    for key, value in replace.items():
        text = re.sub(rf"(?m)^(\s*{key}) .*$", rf"\1 {value}", text)
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def error_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln.strip() for ln in res.stderr.strip().splitlines()]


def assert_refused(res: subprocess.CompletedProcess[str], per_host: dict[str, str]) -> None:
    """Non-zero, a header line, then exactly one line per affected host containing the expected words."""
    assert res.returncode != 0
    lines = error_lines(res)
    assert lines[0].startswith("error: "), lines
    for host, words in per_host.items():
        mine = [ln for ln in lines[1:] if ln.startswith(f"{host}:")]
        assert len(mine) == 1 and words in mine[0], (host, words, lines)


def test_unknown_host_key_refused_then_accept_new(cluster: Cluster, tmp_path: Path, hosts: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    cfg = ssh_config_with(cluster, tmp_path, UserKnownHostsFile=str(known))
    res = orchestrate(cluster, tmp_path / "state", "status", "--hosts", str(hosts), "--ssh-config", str(cfg))
    assert_refused(res, {h.name: f"is unknown: not in {known}" for h in cluster.hosts})
    assert "ssh-keyscan" in res.stderr and "--accept-new-host-keys" in res.stderr
    ok = orchestrate(cluster, tmp_path / "state", "status", "--hosts", str(hosts), "--ssh-config", str(cfg),
                     "--accept-new-host-keys")
    assert ok.returncode == 0
    assert len(known.read_text().splitlines()) == 2  # trusted on first use, written down
    again = orchestrate(cluster, tmp_path / "state", "status", "--hosts", str(hosts), "--ssh-config", str(cfg))
    assert again.returncode == 0


def test_changed_host_key_refused_naming_the_line(cluster: Cluster, tmp_path: Path, hosts: Path) -> None:
    real = Path(cluster.known_hosts).read_text().splitlines()
    h0 = cluster.hosts[0]
    # The host's entry replaced by another key: what a man in the middle (or a reinstall) looks like.
    lines = [ln for ln in real if ln.strip() and h0.addr not in ln.split()[0].split(",")]
    lines.append(f"{h0.addr} ssh-ed25519 {_other_ed25519(tmp_path)}")
    known = tmp_path / "known_hosts"
    known.write_text("# first line\n" + "\n".join(lines) + "\n")
    line_no = known.read_text().splitlines().index(lines[-1]) + 1
    cfg = ssh_config_with(cluster, tmp_path, UserKnownHostsFile=str(known))
    res = orchestrate(cluster, tmp_path / "state", "status", "--hosts", str(hosts), "--ssh-config", str(cfg),
                      "--accept-new-host-keys")  # even trust-on-first-use never accepts a CHANGED key
    assert_refused(res, {h0.name: "CHANGED"})
    assert f"{known}:{line_no}" in res.stderr


def _other_ed25519(tmp_path: Path) -> str:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    return (tmp_path / "other_key.pub").read_text().split()[1]


def test_wrong_ssh_key(cluster: Cluster, tmp_path: Path, hosts: Path) -> None:
    key = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    cfg = ssh_config_with(cluster, tmp_path, IdentityFile=str(key))
    res = orchestrate(cluster, tmp_path / "state", "status", "--hosts", str(hosts), "--ssh-config", str(cfg))
    assert_refused(res, {h.name: "authentication failed" for h in cluster.hosts})


def test_connection_refused_and_unresolvable(cluster: Cluster, tmp_path: Path, data: Data) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(f"{cluster.hosts[0].addr}:2\nno-such-node.invalid\n")
    res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "unreach"))
    assert_refused(res, {f"{cluster.hosts[0].addr}:2": "refused; is sshd running",
                         "no-such-node.invalid": "does not resolve"})


def test_preflight_refusals_one_line_per_host(cluster: Cluster, tmp_path: Path, hosts: Path, data: Data) -> None:
    # Too few GPUs: the test hosts have none (no nvidia-smi), so --gpus 1 is refused on every host.
    res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "gpu", "--gpus", "1"))
    assert_refused(res, {h.name: "nvidia-smi not found" for h in cluster.hosts})
    # An image that exists neither here nor on the nodes, without --pull.
    res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "noimg", "--image", "ddp-cifar:nope"))
    assert_refused(res, {h.name: "ddp-cifar:nope missing here and on this machine" for h in cluster.hosts})
    assert "preflight" in res.stdout  # the table was printed
    for job in ("gpu", "noimg"):
        assert job_containers(cluster, job) == []


def test_master_port_in_use_on_node0(cluster: Cluster, tmp_path: Path, hosts: Path, data: Data) -> None:
    # The port is held until the test closes the holder's stdin, however long `up` takes.
    code = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 29577)); s.listen(); print('ok', flush=True); "
            "sys.stdin.read()")
    listener = subprocess.Popen(in_netns(cluster.hosts[0].netns, [sys.executable, "-c", code]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert LineReader(listener.stdout).next(60, "the port holder to listen").strip() == "ok"
        res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "port", "--master-port", "29577"))
        assert listener.poll() is None, "the port holder ended before `up` was done"
    finally:
        assert listener.stdin is not None
        listener.stdin.close()
        listener.wait(timeout=10)
    assert_refused(res, {cluster.hosts[0].name: "master port 29577 already in use on node 0"})
    assert not any(ln.startswith(cluster.hosts[1].name) for ln in error_lines(res))
    assert job_containers(cluster, "port") == []


def test_node_without_docker(cluster: Cluster, tmp_path: Path, hosts: Path, data: Data) -> None:
    h1 = cluster.hosts[1]
    h1.stop_docker()
    try:
        res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "nodocker"))
    finally:
        h1.start_docker()
    assert_refused(res, {h1.name: "cannot reach the Docker daemon over SSH"})
    assert job_containers(cluster, "nodocker") == []


def test_unwritable_data_dir_and_full_checkpoint_disk(cluster: Cluster, tmp_path: Path, data: Data) -> None:
    """A data dir that cannot be created (a file in its path), and too little free space for checkpoints.

    (A tmpfs mounted here is not seen by the test hosts' sshd, which has a mount namespace of its own, so
    a full disk is simulated with a free-space requirement no disk meets.)
    """
    blocker = tmp_path / "a-file"  # a path as host 0 sees it (its own /tmp)
    on_host = cluster.hosts[0].path(str(blocker))
    on_host.parent.mkdir(parents=True, exist_ok=True)
    on_host.write_text("not a directory")
    hosts = cluster.write_hosts_file(tmp_path / "hosts.txt", keys={0: {"data_dir": str(blocker / "data")}})
    res = orchestrate(cluster, tmp_path / "state", *up_args(hosts, data, "disk", "--min-free-gb", "1000000"))
    assert_refused(res, {cluster.hosts[0].name: f"data dir {blocker / 'data'} cannot be created",
                         cluster.hosts[1].name: "GB free, 1000000 GB needed"})
    assert job_containers(cluster, "disk") == []


def test_wrong_md5_archive(cluster: Cluster, tmp_path: Path, data: Data) -> None:
    fresh_dir = f"~/md5-{tmp_path.name}"  # a data dir no other test filled
    hosts = cluster.write_hosts_file(tmp_path / "hosts.txt", keys={i: {"data_dir": fresh_dir} for i in range(2)})
    args = up_args(hosts, data, "md5")
    args[args.index("--data-md5") + 1] = "0" * 32
    res = orchestrate(cluster, tmp_path / "state", *args, timeout=600)
    assert_refused(res, {h.name: f"expected {'0' * 32}" for h in cluster.hosts})
    assert job_containers(cluster, "md5") == []
    h0 = cluster.hosts[0]
    assert h0.path(f"{h0.home}/{fresh_dir[2:]}").is_dir()  # the dir was made, then nothing was extracted
    assert not h0.path(f"{h0.home}/{fresh_dir[2:]}/cifar-10-batches-py").exists()
