"""The simulated hosts behave like separate machines as they come: own address, stock sshd, a non-root
login in the docker group, own home and temp folders, own dockerd; variants (no SFTP, root login, a
shared folder); and they leave no trace.

Needs root, iproute2, openssh-server, docker.io (dockerd, containerd, runc) and iptables. Fails, never
skips, when one is missing.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import paramiko
import pytest
from kit.orphan import cluster_of_a_child
from kit.waits import wait_until

from devcluster import Cluster, Host, seed
from devcluster.gc import gc
from devcluster.layout import LINK_RE, MAX_HOSTS, NETNS_RE, ClusterState, check_name, state_root
from devcluster.proc import alive, cmdline, pids_in_netns
from devcluster.sshd import SSHD
from devcluster.teardown import TRASH, traces
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
def test_login_is_a_non_root_user_in_the_docker_group(cluster: Cluster) -> None:
    assert f"  User {cluster.user}\n" in cluster.ssh_config.read_text() and cluster.user != "root"
    for h in cluster.hosts:
        res = ssh(cluster, h, "sh", "-c", 'id -un; id -Gn; echo "$HOME"; echo "${DOCKER_HOST-unset}"; hostname -I')
        assert res.returncode == 0, res.stderr
        user, groups, home, docker_host, ips = res.stdout.split("\n")[:5]
        assert (user, home, docker_host) == (cluster.user, f"/home/{cluster.user}", "unset")
        assert "docker" in groups.split()
        assert ips.split() == [h.addr]


@pytest.mark.cluster
def test_root_cannot_log_in_by_default(cluster: Cluster) -> None:
    """Root has no authorized key on a default host, as on most real machines."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster.known_hosts))
    with pytest.raises(paramiko.AuthenticationException):
        client.connect(cluster.hosts[0].addr, username="root", key_filename=str(cluster.key),
                       look_for_keys=False, allow_agent=False, timeout=10)
    client.close()


@pytest.mark.cluster
def test_docker_socket_is_root_docker_0660_at_the_default_path(cluster: Cluster) -> None:
    for h in cluster.hosts:
        res = ssh(cluster, h, "stat", "-L", "-c", "%U:%G %a %F", "/var/run/docker.sock")
        assert res.stdout.strip() == "root:docker 660 socket", res.stderr
        st = h.docker_sock.stat()
        assert (st.st_uid, grp.getgrgid(st.st_gid).gr_name, oct(st.st_mode & 0o777)) == (0, "docker", "0o660")


@pytest.mark.cluster
def test_sshd_runs_with_stock_settings(cluster: Cluster) -> None:
    """Only what makes sshd one host's daemon is set; the effective limits are OpenSSH's defaults."""
    h = cluster.hosts[0]
    config = h.layout.ssh_dir / "sshd_config"
    keys = {line.split()[0] for line in config.read_text().splitlines() if line.strip()}
    assert keys == {"ListenAddress", "HostKey", "PidFile", "Subsystem"}
    effective = h.run([SSHD, "-T", "-f", str(config)]).stdout.splitlines()
    assert {"maxsessions 10", "maxstartups 10:30:100", "permitrootlogin without-password"} <= set(effective)


@pytest.mark.cluster
def test_eleventh_channel_on_one_connection_is_refused(cluster: Cluster) -> None:
    """OpenSSH's MaxSessions 10, as on a real host: the 11th open channel of one connection is refused,
    while another connection still gets its channels."""
    h = cluster.hosts[0]
    clients = [paramiko.SSHClient() for _ in range(2)]
    try:
        for client in clients:
            client.load_host_keys(str(cluster.known_hosts))
            client.connect(h.addr, username=cluster.user, key_filename=str(cluster.key), look_for_keys=False,
                           allow_agent=False, timeout=10)
        transport = clients[0].get_transport()
        assert transport is not None
        channels = [transport.open_session(timeout=10) for _ in range(10)]
        with pytest.raises(paramiko.ChannelException):
            transport.open_session(timeout=10)
        assert all(not c.closed for c in channels)
        _, out, _ = clients[1].exec_command("id -un", timeout=10)
        assert out.read().decode().strip() == cluster.user
    finally:
        for client in clients:
            client.close()


@pytest.mark.cluster
def test_each_host_has_its_own_home_tmp_and_var_tmp(cluster: Cluster) -> None:
    h0, h1 = cluster.hosts
    name = f"own-{os.getpid()}"
    paths = [f"{h0.home}/{name}", f"/tmp/{name}", f"/var/tmp/{name}"]
    try:
        assert ssh(cluster, h0, "touch", *paths).returncode == 0
        for p in paths:
            assert h0.path(p).is_file()
            assert h0.path(p).stat().st_uid == pwd.getpwnam(cluster.user).pw_uid
            assert not h1.path(p).exists() and not Path(p).exists()
        assert ssh(cluster, h1, "ls", *paths).returncode != 0, "h1 sees h0's files"
        assert ssh(cluster, h0, "ls", *paths).returncode == 0
    finally:
        for p in paths:
            h0.path(p).unlink(missing_ok=True)


@pytest.mark.cluster
def test_container_bind_mounts_resolve_in_the_hosts_view(cluster: Cluster) -> None:
    """A container run as the user writes into a bind of the user's home: the file is on that host
    only, and it belongs to the user."""
    h0, h1 = cluster.hosts
    load_tiny_image(h0.docker_client())
    folder = f"{h0.home}/bind-{os.getpid()}"
    try:
        assert ssh(cluster, h0, "mkdir", folder).returncode == 0
        script = f"docker run --rm --user $(id -u):$(id -g) -v {folder}:/out {TINY_IMAGE} sh -c 'echo hi > /out/f'"
        res = ssh(cluster, h0, "sh", "-c", script, timeout=60)
        assert res.returncode == 0, res.stderr
        assert h0.path(f"{folder}/f").read_text() == "hi\n"
        assert h0.foreign_files(folder) == []
        assert not h1.path(folder).exists()
    finally:
        h0.run(["rm", "-rf", folder])


@pytest.mark.cluster
def test_a_folder_planted_by_another_account(cluster: Cluster) -> None:
    h = cluster.hosts[0]
    folder = f"/var/tmp/planted-{os.getpid()}"
    try:
        h.run(["mkdir", "-m", "755", folder], user="nobody")
        assert h.foreign_files(folder) == [f"{folder}/. ({pwd.getpwnam('nobody').pw_uid}:"
                                           f"{pwd.getpwnam('nobody').pw_gid})"]
        assert h.run(["touch", f"{folder}/f"], user=cluster.user, check=False).returncode != 0
    finally:
        h.run(["rm", "-rf", folder])


@pytest.mark.cluster
def test_shared_folder_is_the_same_on_every_host(cluster_factory) -> None:
    c = cluster_factory(2, shared="/mnt/shared")
    h0, h1 = c.hosts
    name = f"/mnt/shared/s-{os.getpid()}"
    assert ssh(c, h0, "sh", "-c", f"echo from-h0 > {name}").returncode == 0
    assert ssh(c, h1, "cat", name).stdout == "from-h0\n"
    assert h0.path(name) == h1.path(name) == c.dir / "shared" / Path(name).name
    assert h0.path(name).stat().st_uid == pwd.getpwnam(c.user).pw_uid
    assert not Path(name).exists(), "the shared folder is the hosts', not the machine's"
    assert ssh(c, h1, "ls", f"/tmp/{Path(name).name}").returncode != 0  # the rest stays per host


@pytest.mark.cluster
def test_host_without_sftp_refuses_the_subsystem(cluster_factory) -> None:
    c = cluster_factory(2, no_sftp=[1])
    assert [h.sftp for h in c.hosts] == [True, False]
    for h in c.hosts:
        client = paramiko.SSHClient()
        client.load_host_keys(str(c.known_hosts))
        client.connect(h.addr, username=c.user, key_filename=str(c.key), look_for_keys=False,
                       allow_agent=False, timeout=10)
        try:
            if h.sftp:
                with client.open_sftp() as sftp:
                    assert sftp.normalize(".") == h.home
            else:
                with pytest.raises(paramiko.SSHException):
                    client.open_sftp()
                _, out, _ = client.exec_command("true", timeout=10)  # exec channels still work
                assert out.channel.recv_exit_status() == 0
        finally:
            client.close()


@pytest.mark.cluster
def test_root_login_variant(cluster_factory) -> None:
    c = cluster_factory(1, root_login=True)
    h = c.hosts[0]
    assert c.user == "root" and "  User root\n" in c.ssh_config.read_text()
    res = ssh(c, h, "sh", "-c", 'id -u; echo "$HOME"; docker info --format "{{.ID}}"')
    assert res.stdout.split() == ["0", "/root", h.docker_client().info()["ID"]], res.stderr


@pytest.mark.cluster
def test_paramiko_checks_host_keys_strictly(cluster: Cluster, tmp_path: Path) -> None:
    h0, h1 = cluster.hosts

    def connect(known_hosts: Path, host: Host) -> None:
        client = paramiko.SSHClient()
        client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(host.addr, username=cluster.user, key_filename=str(cluster.key),
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
        for url in (f"ssh://{cluster.user}@{h.addr}", f"ssh://{h.name}"):
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
def test_reboot_gives_a_new_boot_id_and_a_new_daemon_and_keeps_the_host_key(cluster: Cluster) -> None:
    """What a reboot shows over SSH (the orchestrator tells a reboot from a daemon restart by it): a new boot id,
    a new dockerd pid in /var/run/docker.pid; the host key (strict known_hosts), files and the other host stay."""
    h, other = cluster.hosts[1], cluster.hosts[0]
    probe = "cat /proc/sys/kernel/random/boot_id; cat /var/run/docker.pid"

    def seen(host: Host) -> list[str]:
        res = ssh(cluster, host, "sh", "-c", probe)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    before, other_before = seen(h), seen(other)
    h.path("/home/ddp/kept").write_text("x")
    try:
        h.reboot()
        after = seen(h)
    finally:
        h.path("/home/ddp/kept").unlink()
    assert after[0] != before[0] and after[1] != before[1]
    assert seen(other) == other_before
    assert h.docker_client().ping()


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
    wait_until(lambda: "sleep 1000 " in [cmdline(p) for p in pids_in_netns(h.netns)], 10, "the ssh session to start",
               every=0.2)
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
    proc, c = cluster_of_a_child("1")
    name = c.name
    try:
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
def test_close_does_not_wait_for_the_deletion_of_the_folder_and_gc_finishes_it(cluster_factory) -> None:
    """A file that cannot be deleted yet (immutable, as a slow disk's deletion that has not got to it) in a host's
    folder: close still leaves no trace, at once (the folder goes to the trash, deleted in the background; a
    dockerd data root with an image takes ~40 s to delete on this disk). Once the file may go, gc deletes it."""
    c = cluster_factory(1, fresh=True)
    stuck = c.dir / "h0" / "stuck"
    stuck.write_text("x")
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        assert c.close() == []
    finally:
        moved = list((state_root() / TRASH).glob(f"{c.name}-*/h0/stuck"))
        subprocess.run(["chattr", "-i", *map(str, moved or [stuck])], check=True)
    assert len(moved) == 1, "the folder did not go to the trash"
    gc()
    wait_until(lambda: not moved[0].parents[1].exists(), 60, f"{moved[0].parents[1]} to be deleted", every=0.2)

def _listing(folder: Path) -> list[tuple[str, int, int, int]]:
    """Every file and folder under `folder`: path, size, mtime (ns) and mode (the seed's mark left out: using a
    seed marks it as used)."""
    return sorted((str(p.relative_to(folder)), st.st_size, st.st_mtime_ns, st.st_mode)
                  for p in folder.rglob("*") if p.name != seed.MARK for st in [p.lstat()])


@pytest.mark.cluster
def test_seeded_hosts_start_with_the_image_and_leave_the_seed_as_it_was(cluster_factory, cpu_image: str) -> None:
    """A host made from a seed has the image as if loaded by hand (same ID, a container of it runs). What its
    dockerd does then (a container writing over the image's files, a commit, the image removed and pruned, a
    daemon restart) changes nothing in the seed that the next cluster's hosts link to."""
    c = cluster_factory(1, fresh=True, seeded=True)
    folder = seed.seeds_dir() / seed.key_of([cpu_image])
    before = _listing(folder)
    client = c.hosts[0].docker_client()
    assert client.images.get(cpu_image).id == docker.from_env().images.get(cpu_image).id
    container = client.containers.run(cpu_image, ["sh", "-c", "echo x >> /opt/venv/pyvenv.cfg && rm /bin/ls && "
                                                  "chmod 600 /opt/venv/pyvenv.cfg && python -c 'import torch'"],
                                      entrypoint=[], detach=True)
    assert container.wait(timeout=120)["StatusCode"] == 0, container.logs()
    container.commit("seeded", "changed")
    container.remove()
    client.images.remove(cpu_image, force=True)
    client.images.prune(filters={"dangling": False})
    c.hosts[0].stop_docker()
    c.hosts[0].start_docker()
    assert c.close() == []
    assert _listing(folder) == before
    again = cluster_factory(1, fresh=True, seeded=True)
    assert again.hosts[0].docker_client().images.get(cpu_image).id == docker.from_env().images.get(cpu_image).id
    assert again.close() == []


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
