"""SSH helpers (quoting, known_hosts lookup, connection errors, fan-out) and other pure pieces."""

from __future__ import annotations

import base64
import errno
import http.server
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker.errors
import paramiko
import pytest
from kit.fetching import archive, fetch, serving
from kit.net import free_port

from orchestrate.backends.docker_ssh.datacopy import BATCHES
from orchestrate.errors import MultiHostError, SSHError
from orchestrate.fanout import fan_out
from orchestrate.hosts import Host
from orchestrate.masking import mask_text, masked_env
from orchestrate.remote.docker import dial_command
from orchestrate.remote.identity import Identity
from orchestrate.remote.ssh import Connection, find_known_host_line, quote_command


@pytest.mark.parametrize("evil", ["$(touch /tmp/owned)", "; touch /tmp/owned", "`touch /tmp/owned`",
                                  "a\ntouch /tmp/owned", "' ; touch /tmp/owned ; '", "x && touch /tmp/owned"])
def test_quoted_commands_run_nothing(evil: str, tmp_path: Path) -> None:
    """What we send is one shell word per argument: run it through a real shell and nothing happens."""
    marker = tmp_path / "owned"
    evil = evil.replace("/tmp/owned", str(marker))
    command = quote_command(["printf", "%s", evil], env={"V": evil})
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=10)
    assert out.stdout == evil and not marker.exists()


def test_dial_command_quotes_docker_host() -> None:
    assert dial_command(None) == "docker system dial-stdio"
    assert dial_command("unix:///run/user/1000/docker.sock;id") == \
        "DOCKER_HOST='unix:///run/user/1000/docker.sock;id' docker system dial-stdio"


def test_known_hosts_line_plain_and_hashed(tmp_path: Path) -> None:
    rsa = paramiko.RSAKey.generate(1024)
    hashed = paramiko.HostKeys.hash_host("[10.0.0.5]:2222")
    path = tmp_path / "known_hosts"
    path.write_text(f"# comment\nother.host ssh-rsa {rsa.get_base64()}\n{hashed} ssh-rsa {rsa.get_base64()}\n"
                    f"10.0.0.6 ssh-rsa {rsa.get_base64()}\n")
    assert find_known_host_line([str(path)], "[10.0.0.5]:2222") == (str(path), 3)
    assert find_known_host_line([str(path)], "10.0.0.6") == (str(path), 4)
    assert find_known_host_line([str(path)], "10.0.0.7") is None


def _host(hostname: str, port: int, tmp_path: Path) -> Host:
    return Host(name=hostname, hostname=hostname, port=port, user="u", known_hosts_files=(str(tmp_path / "kh"),))


def test_connection_refused_is_one_clear_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(SSHError, match=r"refused; is sshd running on that port\?"):
        Connection.open(_host("127.0.0.1", port, tmp_path), timeout=5)


def test_a_host_not_reached_is_not_called_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose link is down answers "no route" (paramiko's NoValidConnectionsError, as for a refusal): the
    line says it is not reached, not that sshd refused (seen on a test host right after its link came back)."""
    def unreachable(self: paramiko.SSHClient, hostname: str, port: int, **_: object) -> None:
        raise paramiko.ssh_exception.NoValidConnectionsError(
            {(hostname, port): OSError(errno.EHOSTUNREACH, "No route to host")})

    monkeypatch.setattr(paramiko.SSHClient, "connect", unreachable)
    with pytest.raises(SSHError, match=r"^cannot reach 10\.0\.0\.9 \(10\.0\.0\.9:22\): No route to host; is the host up"):
        Connection.open(_host("10.0.0.9", 22, tmp_path), timeout=5)


def test_unresolvable_host_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(SSHError, match="does not resolve"):
        Connection.open(_host("no-such-host.invalid", 22, tmp_path), timeout=5)


def test_fan_out_collects_every_failure() -> None:
    def work(n: int) -> int:
        if n % 2:
            raise SSHError(f"node{n} broke")
        return n * 10

    assert fan_out("x", [0, 2], work, str) == [0, 20]
    with pytest.raises(MultiHostError) as info:
        fan_out("preflight", [0, 1, 2, 3], work, lambda n: f"h{n}")
    assert info.value.lines() == ["h1: node1 broke", "h3: node3 broke"]


def test_secret_masking() -> None:
    env = {"HF_TOKEN": "t0k", "AWS_SECRET_ACCESS_KEY": "abc", "DB_PASSWORD": "pw", "NCCL_DEBUG": "INFO"}
    assert masked_env(env) == {"HF_TOKEN": "****", "AWS_SECRET_ACCESS_KEY": "****", "DB_PASSWORD": "****",
                               "NCCL_DEBUG": "INFO"}
    assert mask_text("login with t0k and pw", ["t0k", "pw"]) == "login with **** and ****"


def test_cli_does_not_import_torch() -> None:
    """The orchestrator checks trainer options and checkpoint manifests with trainer's stdlib-only modules;
    torch (and so the trainer's torch modules) must never come with them."""
    code = ("import sys, orchestrate.cli, orchestrate.pipeline, orchestrate.jobs.commands, orchestrate.watch.watcher;"
            "from orchestrate.config import UpConfig, SSHOptions;"
            "UpConfig.of(ssh=SSHOptions(None, None, False), trainer_args=('--epochs', '2', '--model', 'resnet50'));"
            "sys.exit(1 if 'torch' in sys.modules or 'trainer.models' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("command", ["logs", "tensorboard", "plot"])
def test_logs_with_every_host_unreachable_names_the_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          command: str) -> None:
    """Not "no container found" (nor tensorboard's and plot's "no container of job 'j' on node 0 and no record of
    its folders"): with no host answering, that says nothing about the job."""
    from rich.console import Console

    from orchestrate.backends.allocators import ALLOCATORS
    from orchestrate.backends.choice import scheduler
    from orchestrate.config import JobsConfig, SSHOptions
    from orchestrate.jobs import commands
    from orchestrate.remote.session import Session

    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("gpu-a\n")
    monkeypatch.setattr(Session, "connect_reachable", classmethod(
        lambda cls, hosts, accept: (cls(hosts, [None]), {"gpu-a": "connection to gpu-a refused"})))
    config = JobsConfig(ssh=SSHOptions(hosts_file, None, False), job="j")
    with pytest.raises(MultiHostError) as err:
        commands.run_jobs_command(command, config, Console(file=open(tmp_path / "out", "w")), scheduler(),  # noqa: SIM115
                                  ALLOCATORS)
    assert err.value.lines() == ["gpu-a: connection to gpu-a refused"] and err.value.what == command


@pytest.mark.parametrize("command", ["tensorboard", "plot"])
def test_node0s_folder_not_found_with_a_host_silent_names_that_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   command: str) -> None:
    """Node 0 may run on the host that did not answer: its folder not found says so."""
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrate.backends.docker_ssh import DockerSSH
    from orchestrate.config import JobsConfig, SSHOptions
    from orchestrate.errors import JobError
    from orchestrate.jobs import commands
    from orchestrate.remote.session import Session

    def not_found(*_: object) -> None:
        raise JobError("no container of job 'j' on node 0 and no record of its folders")

    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("gpu-a\ngpu-b\n")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(Session, "connect_reachable", classmethod(
        lambda cls, hosts, accept: (cls(hosts, [None, object()]), {"gpu-a": "connection to gpu-a refused"})))
    # the scheduler the command is given: Docker over SSH's reach, over the session above
    silent_node0 = SimpleNamespace(reach=DockerSSH().reach, node_dirs=lambda *a: {}, node0_dir=not_found)
    monkeypatch.setattr(Session, "close", lambda self: None)
    config = JobsConfig(ssh=SSHOptions(hosts_file, None, False), job="j")
    with pytest.raises(JobError, match=r"of its folders; no answer from gpu-a$"):
        commands.run_jobs_command(command, config, Console(file=open(tmp_path / "out", "w")), silent_node0,  # noqa: SIM115
                                  ())


def test_tensorboard_fetches_each_nodes_new_or_changed_event_files_through_the_backend(tmp_path: Path) -> None:
    """`tensorboard`'s fetch through Docker over SSH's files_named and read_file, event_files.sh run by a local
    shell as sshd would: the event files of a log dir (a name with a space included) copied under out/node<N>/,
    its other files left there; fetched again, only a file that changed size is copied."""
    from orchestrate.backends.docker_ssh import DockerSSH
    from orchestrate.jobs.tensorboard import fetch
    from orchestrate.remote.session import Session
    from orchestrate.remote.ssh import Result

    class LocalConn:
        def run(self, argv: list[str], timeout: float = 60.0) -> Result:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            return Result(done.returncode, done.stdout, done.stderr)

        def read_file(self, path: str) -> bytes:
            return Path(path).read_bytes()

        def close(self) -> None:
            pass

    logs = tmp_path / "logs"
    (logs / "tensorboard").mkdir(parents=True)
    (logs / "my run").mkdir()
    (logs / "tensorboard" / "events.out.tfevents.1.vm.7.0").write_bytes(b"first")
    (logs / "my run" / "events.out.tfevents.2").write_bytes(b"second")
    (logs / "heartbeat.json").write_text("{}")
    nodes = Session([Host(name="h0", hostname="h0", port=22, user="u")], [LocalConn()])  # type: ignore[list-item]
    out = tmp_path / "out"
    assert fetch(DockerSSH(), nodes, {0: (0, str(logs))}, out) == 2
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "node0/my run/events.out.tfevents.2", "node0/tensorboard/events.out.tfevents.1.vm.7.0"]
    assert fetch(DockerSSH(), nodes, {0: (0, str(logs))}, out) == 0
    (logs / "my run" / "events.out.tfevents.2").write_bytes(b"second, grown")
    assert fetch(DockerSSH(), nodes, {0: (0, str(logs))}, out) == 1
    assert (out / "node0" / "my run" / "events.out.tfevents.2").read_bytes() == b"second, grown"


def test_write_and_read_files_through_exec_channels(tmp_path: Path) -> None:
    """The file transfer scripts, run by a local shell as sshd would: an unpredictable temporary name (never a
    planted symlink), the target replaced atomically, a symlink at the target replaced rather than followed."""
    from orchestrate.remote.ssh import WRITE_SCRIPT

    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "archive.tar.gz"
    target.symlink_to(victim)
    (tmp_path / "archive.tar.gz.part").symlink_to(victim)  # where the old code wrote first
    res = subprocess.run(["sh", "-c", WRITE_SCRIPT, "write", str(target)], input=b"new bytes", capture_output=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "keep"
    assert not target.is_symlink() and target.read_bytes() == b"new bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive.tar.gz", "archive.tar.gz.part", "victim"]


class _FakeChannel:
    def __init__(self) -> None:
        self.closed = False


class _FakeTransport:
    """A server that refuses channels past `limit` on one connection, as sshd does past MaxSessions."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._channels: dict[int, _FakeChannel] = {}

    def is_active(self) -> bool:
        return self.active

    active = True

    def open_session(self, timeout: float) -> _FakeChannel:
        if sum(not c.closed for c in self._channels.values()) >= self.limit:
            raise paramiko.ChannelException(2, "Connect failed")
        chan = _FakeChannel()
        self._channels[len(self._channels)] = chan
        return chan


class _FakeClient:
    def __init__(self, limit: int) -> None:
        self.transport = _FakeTransport(limit)

    def get_transport(self) -> _FakeTransport:
        return self.transport

    def close(self) -> None:
        pass


def _fake_connections(monkeypatch: pytest.MonkeyPatch, limit: int) -> tuple[list[_FakeClient], Any]:
    """ssh._connect replaced: each new connection is a _FakeClient allowing `limit` channels; (those made, connect)."""
    from orchestrate.remote import ssh

    made: list[_FakeClient] = []

    def connect(host: Host, accept: bool, timeout: float) -> _FakeClient:
        made.append(_FakeClient(limit=limit))
        return made[-1]

    monkeypatch.setattr(ssh, "_connect", connect)
    return made, connect


def test_a_refused_channel_opens_another_connection_not_an_unreachable_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A site whose sshd allows 3 channels per connection: 7 channels at once still open (3 connections), and
    once every allowed connection is full the error is a channel limit, never 'unreachable'."""
    from orchestrate.remote import ssh

    made, connect = _fake_connections(monkeypatch, limit=3)
    host = Host(name="h", hostname="h", port=22, user="ddp")
    conn = Connection(host, connect(host, False, 1), False)  # type: ignore[arg-type]
    chans = [conn.open_channel() for _ in range(7)]
    assert len(chans) == 7 and len(made) == 3 and conn.peak_channels == 7
    chans[0].closed = True  # a channel handed back makes room on its connection again
    conn.open_channel()
    assert len(made) == 3
    for _ in range(5):  # 3 connections x 3 + room on a 4th: then every connection refuses
        conn.open_channel()
    with pytest.raises(ssh.ChannelLimitError) as err:
        conn.open_channel()
    assert "unreachable" not in str(err.value) and "MaxSessions" in str(err.value)


def test_a_dropped_connection_is_opened_again_and_an_unreachable_host_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The main connection ended (a reset, a killed sshd session): the next channel comes from a new connection;
    when the host does not answer that connection either, the error names it."""
    from orchestrate.remote import ssh

    made: list[_FakeClient] = []

    def connect(host: Host, accept: bool, timeout: float) -> _FakeClient:
        if len(made) >= 2:
            raise SSHError(f"connecting to {host.label} (h:22) timed out after 10 s; is the host up?")
        made.append(_FakeClient(limit=10))
        return made[-1]

    monkeypatch.setattr(ssh, "_connect", connect)
    host = Host(name="h", hostname="h", port=22, user="ddp")
    conn = Connection(host, connect(host, False, 1), False)  # type: ignore[arg-type]
    made[0].transport.active = False
    conn.open_channel()
    assert len(made) == 2 and made[1].transport._channels and conn.client is made[1]
    made[1].transport.active = False
    with pytest.raises(SSHError, match="connecting to h .*timed out"):
        conn.open_channel()


class _DyingTransport(_FakeTransport):
    """Active when looked at; the connection ends while the channel is being opened (paramiko then raises)."""

    def open_session(self, timeout: float) -> _FakeChannel:
        self.active = False
        raise paramiko.SSHException("SSH session not active")


def test_a_drop_landing_while_a_channel_opens_is_opened_again_not_named_unreachable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop lands between the check of the connection and the open (CI saw the checkpoint replicator report
    `HOST unreachable: cannot open an SSH channel ()` this way, under a job whose host answered): one new connection."""
    made, _ = _fake_connections(monkeypatch, limit=10)
    host = Host(name="h", hostname="h", port=22, user="ddp")
    dying = _FakeClient(limit=10)
    dying.transport = _DyingTransport(limit=10)
    conn = Connection(host, dying, False)  # type: ignore[arg-type]
    conn.open_channel()
    assert len(made) == 1 and conn.client is made[0] and made[0].transport._channels


def test_a_log_stream_followed_again_shows_each_line_once() -> None:
    """Lines come with Docker's stamps (nanoseconds, trailing zeros cut) in any chunking; a stream opened again
    after a break starts a second before the last line shown and repeats none of it."""
    from orchestrate.backends.docker_ssh.control import LogResume, stamp_ns

    assert stamp_ns("2026-11-23T10:12:04.1234Z") == stamp_ns("2026-11-23T10:12:04Z") + 123_400_000  # type: ignore[operator]
    assert stamp_ns("not-a-stamp") is None and stamp_ns("2026-11-23T10:12:04.12x4Z") is None
    resume = LogResume()
    assert resume.since() is None
    first = [b"2026-11-23T10:12:04.1Z epoch 1\n2026-11-23T10:12:0", b"4.2Z epoch 2\n2026-11-23T10:12:04.25Z ep"]
    assert list(resume.unstamped(first)) == [b"epoch 1\n", b"epoch 2\n", b"ep"]
    assert resume.since() == pytest.approx(stamp_ns("2026-11-23T10:12:03.25Z") / 1e9)  # type: ignore[operator]
    again = [b"2026-11-23T10:12:04.2Z epoch 2\n2026-11-23T10:12:04.25Z ep\n2026-11-23T10:12:05Z epoch 3\n"]
    assert list(resume.unstamped(again)) == [b"epoch 3\n"]


def test_node_log_lines_are_masked_and_cannot_drive_the_terminal() -> None:
    import io as _io

    from rich.console import Console

    from orchestrate.loglines import print_lines

    out = _io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    secret = "line-one-secret\nline-two-secret"
    print_lines(console, 1, "title \x1b]0;pwned\x07 clear \x1b[2J\nkey line-one-secret\n(other)\nline-two-secret end\n",
                [secret])
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\\x1b]0;pwned\\x07" in text
    assert "secret" not in text and text.count("****") == 2


def test_a_mistyped_env_never_echoes_its_value(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrate import cli

    code = cli.main(["up", "--hosts", "h.txt", "--env", "HF_TOKEN:s3cr3t", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "s3cr3t" not in err and "--env number 1 has no NAME=" in err


def _basic_auth(blob: bytes, user: str, password: str) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler that answers `blob` to any GET with that user's password, 401 to any other."""
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            ok = self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(blob) if ok else 0))
            self.end_headers()
            self.wfile.write(blob if ok else b"")

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def test_the_fetch_script_takes_credentials_from_the_url_and_never_shows_them(tmp_path: Path) -> None:
    """The URL reaches the node's fetch container in its environment (not argv, which `ps` shows to every
    account); user:password@ works as Basic authorization and is masked in every message."""
    (tmp_path / "www").mkdir()
    md5 = archive(tmp_path / "www" / "c.tar.gz", b"")
    with serving(_basic_auth((tmp_path / "www" / "c.tar.gz").read_bytes(), "alice", "pa55word")) as base:
        where = base.removeprefix("http://")
        bad = fetch(f"http://alice:pa55word@{where}/c.tar.gz", "0" * 32, tmp_path)
        assert bad.returncode == 3 and "pa55word" not in bad.stdout + bad.stderr and "//****@" in bad.stdout
        denied = fetch(f"http://alice:wrong@{where}/c.tar.gz", md5, tmp_path)
        assert denied.returncode == 4 and "401" in denied.stdout and "wrong" not in denied.stdout
        good = fetch(f"http://alice:pa55word@{where}/c.tar.gz", md5, tmp_path)
        assert good.returncode == 0 and "DONE" in good.stdout, good.stdout + good.stderr
        assert (tmp_path / BATCHES / "data_batch_1").is_file()


class _ExitStatusFirstChannel:
    """An exec channel as OpenSSH may drive it: the exit status arrives first, the last output after it."""

    def __init__(self) -> None:
        self.polls, self.closed, self.eof_received = 0, False, False
        self.pending = b""

    def exit_status_ready(self) -> bool:
        return True

    def recv_ready(self) -> bool:
        self.polls += 1
        if self.polls == 3:  # the output shows up a little after the exit status
            self.pending, self.eof_received = b"/home/ddp\n", True
        return bool(self.pending)

    def recv(self, n: int) -> bytes:
        out, self.pending = self.pending, b""
        return out

    def recv_stderr_ready(self) -> bool:
        return False


def test_output_after_the_exit_status_is_still_read() -> None:
    import time

    from orchestrate.remote.ssh import _drain

    out, err = _drain(_ExitStatusFirstChannel(), time.monotonic() + 5, "h", "id")  # type: ignore[arg-type]
    assert out == b"/home/ddp\n" and err == b""


def test_a_kill_cut_short_by_a_dropped_connection_is_done_again_but_a_silent_host_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kill_job on two hosts whose first stop fails: the host whose connection dropped is killed on a new one;
    the host whose connection is still open (it stopped answering) is reported, not tried twice."""
    import io as _io

    from rich.console import Console

    from orchestrate.backends.docker_ssh import control as jobs

    class _Conn:
        def __init__(self, dropped: bool) -> None:
            self.dropped = dropped

        def identity(self) -> Identity:
            return Identity(1000, 1000, "ddp", "/home/ddp")

    class _Nodes:
        hosts = [Host(name="a", hostname="a", port=22, user="ddp"), Host(name="b", hostname="b", port=22, user="ddp")]
        conns = [_Conn(True), _Conn(False)]

        def reachable(self) -> list[int]:
            return [0, 1]

        def lost(self) -> dict[str, str]:
            return {}

        def conn(self, rank: int) -> _Conn:
            return self.conns[rank]

        def docker(self, rank: int) -> int:
            return rank

    tries: list[int] = []

    def kill_on_host(client: int, job: str, grace: float, label: str, uid: int) -> jobs.KillResult:
        tries.append(client)
        if tries.count(client) == 1:
            raise SSHError(f"{label}: Connection aborted")
        return jobs.KillResult(label, ["j-node0"], {"j-node0": 143})

    monkeypatch.setattr(jobs, "kill_on_host", kill_on_host)
    with pytest.raises(MultiHostError) as err:
        jobs.kill_job(_Nodes(), "j", 5, Console(file=_io.StringIO()))  # type: ignore[arg-type]
    assert sorted(tries) == [0, 0, 1] and list(err.value.failures) == ["b"]


def test_a_node_found_down_is_not_waited_for_again_by_the_stop_nor_the_checkpoint_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the watcher has lost a node (no answer for 15 s), the job's stop and the newest-checkpoint search that
    follow skip it at once and say why, instead of paying the SSH timeouts there again (30 s each on the test hosts
    before, the restart a minute later). The host still counts as not stopped: `up` says to kill once it answers."""
    import io as _io

    from rich.console import Console

    from orchestrate.backends.docker_ssh import control as jobs
    from orchestrate.backends.docker_ssh import ranks as container_ranks
    from orchestrate.remote.session import Session
    from orchestrate.watch.report import newest_step

    class _Conn:
        dropped = False

        def identity(self) -> Identity:
            return Identity(1000, 1000, "ddp", "/home/ddp")

        def close(self) -> None:
            pass

    hosts = [Host(name=n, hostname=n, port=22, user="ddp") for n in ("a", "b")]
    nodes = Session(hosts, [_Conn(), _Conn()])  # type: ignore[list-item]
    nodes.lose(1, "it answered nothing for 16 s")
    assert nodes.reachable() == [0]
    with pytest.raises(SSHError, match=r"^b unreachable: it answered nothing for 16 s$"):
        nodes.conn(1)
    tried: list[str] = []

    def kill_on_host(client: object, job: str, grace: float, label: str, uid: int) -> jobs.KillResult:
        tried.append(label)
        return jobs.KillResult(label, ["j-node0"], {"j-node0": 143})

    monkeypatch.setattr(jobs, "kill_on_host", kill_on_host)
    monkeypatch.setattr(Session, "docker", lambda self, rank, timeout=60.0: object())
    with pytest.raises(MultiHostError) as err:
        jobs.kill_job(nodes, "j", 5, Console(file=_io.StringIO()))
    assert tried == ["a"] and err.value.failures == {"b": "b unreachable: it answered nothing for 16 s"}
    searched: list[object] = []
    monkeypatch.setattr(container_ranks, "newest_valid", lambda conn, folder: searched.append(conn))
    specs = [type("Spec", (), {"dirs": {"ckpt": "/c"}, "host": h})() for h in hosts]
    ranks = container_ranks.ContainerRanks(nodes, [type("C", (), {"id": f"c{i}"})() for i in range(2)])
    assert newest_step(ranks, specs) is None and searched == [nodes.conns[0]]  # type: ignore[arg-type]


def test_a_kill_racing_another_stop_of_the_same_job_takes_gone_or_being_removed_as_stopped() -> None:
    """A `kill` typed while an attached `up` stops the same job: Docker answers the second remover 409 (removal
    already in progress) or 404 (gone). Both mean the container is being removed, which is what kill wants."""
    import requests

    from orchestrate.backends.docker_ssh import control as jobs
    from orchestrate.labels import JOB_LABEL, RANK_LABEL

    def _error(kind: type[docker.errors.APIError], status: int) -> docker.errors.APIError:
        response = requests.Response()
        response.status_code = status
        return kind("conflict", response=response)

    class _Container:
        def __init__(self, name: str, on_remove: docker.errors.APIError | None, on_reload: Exception | None) -> None:
            self.name, self.status, self.attrs = name, "exited", {"State": {"ExitCode": 143}}
            self.labels = {JOB_LABEL: "j", RANK_LABEL: name[-1]}
            self.on_remove, self.on_reload = on_remove, on_reload

        def reload(self) -> None:
            if self.on_reload:
                raise self.on_reload

        def remove(self, force: bool) -> None:
            if self.on_remove:
                raise self.on_remove

    containers = [_Container("j-node0", _error(docker.errors.APIError, 409), None),
                  _Container("j-node1", None, _error(docker.errors.NotFound, 404))]

    class _Client:
        class containers:  # noqa: N801  # docker-py's attribute name
            @staticmethod
            def list(all: bool, filters: dict[str, str], ignore_removed: bool = False) -> list[_Container]:  # noqa: A002
                return containers if JOB_LABEL in filters.get("label", "") else []

    res = jobs.kill_on_host(_Client(), "j", 1, "h", 1000)
    assert res.exit_codes == {"j-node0": 143}
    containers[0].on_remove = _error(docker.errors.APIError, 500)  # any other answer is still a failure
    with pytest.raises(docker.errors.APIError):
        jobs.kill_on_host(_Client(), "j", 1, "h", 1000)


def test_output_to_a_file_is_what_a_100_column_terminal_shows_without_padding(capsys: pytest.CaptureFixture[str]) -> None:
    """Slurm's batch output, nohup, a CI log: tables were padded to 200 columns, their titles centred at column 100
    and every line ending in blanks. Now a table is as wide as its content and at most 100 columns, no line ends in
    a blank, and a line of text stays whole."""
    from rich.table import Table

    from orchestrate.terminal import console_for

    def table(cell: str) -> Table:
        made = Table(title="preflight")
        for col in ("host", "gpus", "disk"):
            made.add_column(col, overflow="fold")
        made.add_row("gpu-a", cell, "ok")
        return made

    out, err = console_for(), console_for(stderr=True)  # capsys: neither stream is a terminal
    out.print(table("GPU 0,1 of 8; others: " + "job-x " * 40))
    out.print(table("GPU 0"))
    text_line = "[node 0] " + "epoch 3 step 120 " * 12
    out.print(text_line, markup=False)
    err.print(table("GPU 0"))
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert max(map(len, lines[:-1])) == 100 and lines[0] == " " * 45 + "preflight"  # centred in the wide table's 100
    narrow = lines[lines.index(next(line for line in lines[1:] if "preflight" in line)) + 1]
    assert len(narrow) == 24 and lines[-1] == text_line.rstrip()  # as wide as its content; text never broken
    assert not [line for line in lines + captured.err.splitlines() if line.endswith(" ")]
    assert captured.err.splitlines()[0] == " " * 7 + "preflight"  # the narrow table on stderr alike


def test_the_status_table_in_100_columns_keeps_names_and_checkpoints_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """What a file gets of `status`, with names as long as the test hosts' (CI: the state and container columns were
    cut to `exi…` and `hup-node0…`): every cell whole in at most 100 columns, the exit code beside the state, the
    checkpoint's file name; each node's last log line whole, on a line of its own after the table."""
    from types import SimpleNamespace

    from orchestrate.jobs import commands
    from orchestrate.terminal import console_for

    def row(node: int) -> SimpleNamespace:
        return SimpleNamespace(node=str(node), host=f"dc-40287c-h{node}", name=f"heal-kill-node{node}-ddp",
                               state="exited", exit="137", uptime="0h00m19s", checkpoint="ckpt-00000008.pt",
                               last_line="[default0]:00:11:56 [rank 0] INFO epoch 1 step 1 loss 2.3936 images/s 15 "
                                         "and a tail long enough to pass the width of any table here")

    scheduler = SimpleNamespace(describe=lambda *_: SimpleNamespace(rows=[row(0), row(1)], lines=[]))
    commands.print_status(scheduler, None, "heal-kill", console_for(), {})  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines if "last log line" not in line) <= 100
    for node in (0, 1):
        assert re.search(rf"│ {node} +│ dc-40287c-h{node} │ heal-kill-node{node}-ddp │ exited \(137\) │ 0h00m19s │ "
                         rf"ckpt-00000008.pt │$", "\n".join(lines), re.MULTILINE)
        assert f"node {node} last log line: {row(node).last_line}" in lines
