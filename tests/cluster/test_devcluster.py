"""The simulated hosts behave like separate machines: own address, sshd, dockerd; and leave no trace.

Needs root, iproute2, openssh-server, docker.io (dockerd, containerd, runc) and iptables. Fails, never
skips, when one is missing.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import paramiko
import pytest

from devcluster import Cluster, Host
from devcluster.gc import gc
from devcluster.layout import LINK_RE, MAX_HOSTS, NETNS_RE, ClusterState, check_name, state_root
from devcluster.proc import alive, cmdline, pids_in_netns
from devcluster.teardown import traces
from devcluster.tinyimage import TINY_IMAGE, load_tiny_image

REPO = Path(__file__).resolve().parents[2]


def tcp_banner(src: Host, dst: Host, timeout: int = 5) -> subprocess.CompletedProcess[str]:
    """From inside src's netns, open TCP to dst:22 and read sshd's banner (bash's /dev/tcp)."""
    script = f"exec 3<>/dev/tcp/{dst.addr}/22; head -c 7 <&3"
    return src.run(["timeout", str(timeout), "bash", "-c", script], check=False, timeout=timeout + 5)


def ssh(c: Cluster, host: Host, *cmd: str, timeout: int = 20) -> subprocess.CompletedProcess[str]:
    """OpenSSH joins its arguments into one shell line on the host: quote each of them."""
    return subprocess.run(c.ssh_argv(host, shlex.join(cmd)), capture_output=True, text=True, timeout=timeout)


# --- unit: names (no root needed) -----------------------------------------------------------------

def test_names_fit_linux_limits() -> None:
    state = ClusterState(name="abcdefgh", subnet_index=7, n_hosts=MAX_HOSTS)
    last = state.host(MAX_HOSTS - 1)
    assert len(last.veth) <= 15 and len(state.bridge) <= 15
    assert LINK_RE.match(last.veth) and LINK_RE.match(state.bridge) and NETNS_RE.match(last.netns)
    assert last.addr == f"10.231.7.{MAX_HOSTS + 1}"
    for bad in ("", "UPPER", "a-b", "toolongname"):
        with pytest.raises(Exception, match="1-8 characters"):
            check_name(bad)


# --- the shared 2-host cluster --------------------------------------------------------------------

@pytest.mark.cluster
def test_hosts_have_distinct_addresses_on_the_subnet(cluster: Cluster) -> None:
    addrs = [h.addr for h in cluster.hosts]
    assert len(set(addrs)) == len(addrs) == 2
    net = ipaddress.ip_network(cluster.subnet)
    for h in cluster.hosts:
        assert ipaddress.ip_address(h.addr) in net
        eth0 = h.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"{h.addr}/24" in eth0
    lines = cluster.hosts_file.read_text().split("\n")
    assert lines[:2] == [f"{h.name} slots=1" for h in cluster.hosts]


@pytest.mark.cluster
def test_dns_lookups_fail_at_once(cluster: Cluster) -> None:
    t0 = time.monotonic()
    res = cluster.hosts[0].run([sys.executable, "-c", "import socket; socket.getaddrinfo('example.com', 80)"],
                               check=False, timeout=30)
    assert res.returncode != 0
    assert time.monotonic() - t0 < 3, "a lookup waited for the unreachable resolver"


@pytest.mark.cluster
def test_openssh_reaches_each_host_with_its_own_docker_host(cluster: Cluster) -> None:
    for h in cluster.hosts:
        res = ssh(cluster, h, "sh", "-c", "echo $DOCKER_HOST; hostname -I")
        assert res.returncode == 0, res.stderr
        docker_host, ips = res.stdout.split("\n")[:2]
        assert docker_host == h.docker_host
        assert ips.split() == [h.addr]


@pytest.mark.cluster
def test_paramiko_checks_host_keys_strictly(cluster: Cluster, tmp_path: Path) -> None:
    h0, h1 = cluster.hosts

    def connect(known_hosts: Path, host: Host) -> None:
        client = paramiko.SSHClient()
        client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(host.addr, username="root", key_filename=str(cluster.key),
                           look_for_keys=False, allow_agent=False, timeout=10)
            _, out, _ = client.exec_command("true")
            assert out.channel.recv_exit_status() == 0
        finally:
            client.close()

    for h in cluster.hosts:
        connect(cluster.known_hosts, h)
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(empty, h0)
    # h1's key filed under h0's address: a changed host key
    key_of_h1 = cluster.known_hosts.read_text().splitlines()[1].split()[1:]
    wrong = tmp_path / "wrong"
    wrong.write_text(f"{h0.addr} {' '.join(key_of_h1)}\n")
    with pytest.raises(paramiko.BadHostKeyException):
        connect(wrong, h0)


@pytest.mark.cluster
def test_docker_sdk_over_ssh_reaches_each_hosts_own_daemon(cluster: Cluster,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """docker-py's ssh:// adapter (paramiko) reads ~/.ssh from $HOME: HOME=cluster.home is what works.
    (use_ssh_client=True runs OpenSSH, which ignores $HOME, so it does not.)"""
    monkeypatch.setenv("HOME", str(cluster.home))
    ids = set()
    for h in cluster.hosts:
        local = h.docker_client().info()
        for url in (f"ssh://root@{h.addr}", f"ssh://{h.name}"):
            client = docker.DockerClient(base_url=url, timeout=30)
            try:
                info = client.info()
            finally:
                client.close()
            assert info["ID"] == local["ID"]
            assert info["DockerRootDir"] == str(h.dir / "docker")
        ids.add(local["ID"])
    assert len(ids) == len(cluster.hosts), "hosts share a daemon ID"


@pytest.mark.cluster
def test_docker_cli_over_ssh_shows_each_host_its_own_daemon(cluster: Cluster) -> None:
    seen = {}
    for h in cluster.hosts:
        res = ssh(cluster, h, "docker", "info", "--format", "{{.ID}} {{.DockerRootDir}}")
        assert res.returncode == 0, res.stderr
        seen[h.name] = res.stdout.split()
        assert seen[h.name] == [h.docker_client().info()["ID"], str(h.dir / "docker")]
    assert len({v[0] for v in seen.values()}) == len(cluster.hosts)
    # the default socket path seen over SSH is the host's own daemon too, never the machine's root one
    root_id = docker.from_env().info()["ID"]
    for h in cluster.hosts:
        res = ssh(cluster, h, "docker", "-H", "unix:///var/run/docker.sock", "info", "--format", "{{.ID}}")
        assert res.stdout.strip() == seen[h.name][0] != root_id


@pytest.mark.cluster
def test_host_network_container_sees_its_hosts_address(cluster: Cluster) -> None:
    for h in cluster.hosts:
        client = h.docker_client()
        load_tiny_image(client)
        out = client.containers.run(TINY_IMAGE, ["ip", "-4", "-o", "addr", "show"], network_mode="host",
                                    remove=True).decode()
        assert f"{h.addr}/24" in out
        assert not [o.addr for o in cluster.hosts if o is not h and o.addr in out]


@pytest.mark.cluster
def test_hosts_reach_each_other_over_tcp(cluster: Cluster) -> None:
    h0, h1 = cluster.hosts
    for src, dst in ((h0, h1), (h1, h0)):
        res = tcp_banner(src, dst)
        assert res.stdout == "SSH-2.0", f"{src.name} -> {dst.name}: {res.stderr}"


@pytest.mark.cluster
def test_link_down_cuts_the_host_off_and_link_up_restores_it(cluster: Cluster) -> None:
    h0, h1 = cluster.hosts
    h0.link_down()
    try:
        assert tcp_banner(h1, h0, timeout=2).returncode == 124  # hangs, as with a pulled cable
        assert ssh(cluster, h0, "true").returncode != 0
    finally:
        h0.link_up()
    assert tcp_banner(h1, h0).stdout == "SSH-2.0"
    assert ssh(cluster, h0, "true").returncode == 0


@pytest.mark.cluster
def test_stop_docker_leaves_a_host_without_docker(cluster: Cluster) -> None:
    h = cluster.hosts[1]
    h.stop_docker()
    try:
        res = ssh(cluster, h, "docker", "info")
        assert res.returncode != 0
        assert ssh(cluster, h, "true").returncode == 0  # sshd is still there
    finally:
        h.start_docker()
    own_id = h.docker_client().info()["ID"]
    for sock in ([], ["-H", "unix:///var/run/docker.sock"]):  # the new socket, by both paths
        assert ssh(cluster, h, "docker", *sock, "info", "--format", "{{.ID}}").stdout.strip() == own_id


@pytest.mark.cluster
def test_four_hosts_reach_host_zero(cluster_factory) -> None:
    c = cluster_factory(4)
    assert len({h.addr for h in c.hosts}) == 4
    for h in c.hosts[1:]:
        assert tcp_banner(h, c.hosts[0]).stdout == "SSH-2.0", h.name


# --- fresh clusters -------------------------------------------------------------------------------

@pytest.mark.cluster
def test_second_cluster_does_not_collide(cluster: Cluster, cluster_factory) -> None:
    other = cluster_factory(1, fresh=True)
    assert other.subnet != cluster.subnet and other.name != cluster.name
    assert tcp_banner(other.hosts[0], cluster.hosts[0], timeout=2).returncode != 0  # separate networks
    assert not other.close()


def _busy_host(c: Cluster) -> subprocess.Popen[bytes]:
    """Give teardown real work: containers (host network and their own netns) and an ssh session."""
    h = c.hosts[0]
    client = h.docker_client()
    load_tiny_image(client)
    client.containers.run(TINY_IMAGE, ["sleep", "1000"], network_mode="host", detach=True)
    client.containers.run(TINY_IMAGE, ["sleep", "1000"], network_mode="none", detach=True)
    session = subprocess.Popen(c.ssh_argv(h, "sleep", "1000"), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while "sleep 1000 " not in [cmdline(p) for p in pids_in_netns(h.netns)]:
        assert time.monotonic() < deadline, "the ssh session did not start"
        time.sleep(0.2)
    return session


@pytest.mark.cluster
def test_close_leaves_no_trace(cluster_factory) -> None:
    c = cluster_factory(2, fresh=True)
    session = _busy_host(c)
    assert c.traces(), "a live cluster must show up in traces()"
    assert c.close() == []
    assert session.wait(timeout=10) != 0, "the ssh session outlived its host"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(c.dir) not in mounts
    assert not [line for line in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout.split("\n")
                if line.startswith(f"dc-{c.name}-")]


@pytest.mark.cluster
def test_gc_removes_the_cluster_of_a_killed_run() -> None:
    """A process makes a cluster and is SIGKILLed: its daemons live on, and gc removes them all."""
    code = ("import sys, time; from devcluster import Cluster; c = Cluster.create(1); "
            "print(c.name, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name, "the child did not make a cluster"
        c = Cluster.load(name)
        assert c.hosts[0].docker_client().ping()
        assert name not in gc(), "gc must keep a cluster whose owner lives"
        assert c.traces()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert not alive(proc.pid)
    removed = gc()
    assert removed.get(name) == [], removed
    assert c.traces() == []


@pytest.mark.cluster
def test_cli_up_ls_down() -> None:
    name = f"cli{os.getpid() % 100000}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "devcluster", *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=REPO)

    up = cli("up", "--hosts", "1", "--name", name)
    try:
        assert up.returncode == 0, up.stderr
        assert f"state folder: {state_root() / name}" in up.stdout
        assert name in cli("ls").stdout
        again = cli("up", "--hosts", "1", "--name", name)
        assert again.returncode == 2 and again.stderr.startswith(f"error: cluster '{name}' exists")
        assert cli("gc").returncode == 0
        assert Cluster.load(name).hosts[0].docker_client().ping(), "gc removed a persistent cluster"
    finally:
        down = cli("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert traces(name) == []
    assert cli("down", "--name", name).returncode == 2
