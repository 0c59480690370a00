"""Bad input: one clear line naming the problem and what to do, a non-zero exit, nothing started.

Every case below is refused before any host is contacted (the tests make connecting fail loudly).
Cases that need a real host are in tests/cluster/test_orchestrate_bad_input.py (marked "cluster").

The cases, and the words their one line must hold, are the table CASES below.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orchestrate import cli


@pytest.fixture
def hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    import orchestrate.remote.ssh as ssh

    monkeypatch.setattr(ssh.Connection, "open", lambda *a, **k: pytest.fail("bad input must not connect"))
    path = tmp_path / "hosts"
    path.write_text("node-a\nnode-b\n")
    return path


def hosts_with(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad_hosts"
    path.write_text(text, encoding="utf-8")
    return str(path)


CASES: list[tuple[str, list[str], str]] = [
    ("missing hosts file", ["up", "--hosts", "{tmp}/nope"], "does not exist; write one host a line"),
    ("empty hosts file", ["up", "--hosts", "@# nothing\n\n"], "lists no hosts"),
    ("bad line", ["up", "--hosts", "@a;touch /tmp/owned\n"], ":1: bad host name"),
    ("duplicate", ["up", "--hosts", "@a\na\n"], ":2: duplicate host 'a'"),
    ("slots=0", ["up", "--hosts", "@a slots=0\n"], ":1: slots=0 must be between 1 and 1024"),
    ("unknown key", ["up", "--hosts", "@a gpus=1\n"], ":1: unknown key 'gpus'"),
    ("bad port", ["up", "--hosts", "@a:70000\n"], ":1: port 70000 out of range"),
    ("relative dir", ["up", "--hosts", "@a data_dir=data\n"], "data_dir must be an absolute path"),
    ("ssh config", ["up", "--ssh-config", "{tmp}/none"], "ssh config"),
    ("gpus negative", ["up", "--gpus", "-2"], "--gpus -2 is negative"),
    ("gpus word", ["up", "--gpus", "many"], "--gpus 'many': give a number"),
    ("unknown trainer option", ["up", "--", "--epoch", "3"], "trainer options after '--': unrecognized arguments: --epoch 3"),
    ("batch size 0", ["up", "--", "--batch-size", "0"], "--batch-size must be a positive integer"),
    ("epochs negative", ["up", "--", "--epochs=-1"], "--epochs must be a positive integer"),
    ("missing value", ["up", "--", "--lr"], "argument --lr: expected one argument"),
    ("model no model can be", ["up", "--", "--model", "does-not-exist"], "--model 'does-not-exist' is not a model"),
    ("lr nan", ["up", "--", "--lr", "nan"], "--lr must be a finite number"),
    ("sync-bn with --gpus 0", ["up", "--gpus", "0", "--", "--sync-bn"], "--sync-bn needs a GPU"),
    ("fsdp with compression", ["up", "--", "--strategy", "fsdp", "--grad-compression", "fp16"],
     "--strategy fsdp cannot honour --grad-compression: FSDP2 has no DDP communication hooks"),
    ("abbreviated reserved option", ["up", "--", "--data", "/x"], "unrecognized arguments: --data"),
    ("image name too long", ["up", "--image", "a" * 500], "at most 456 characters"),
    ("nproc too many", ["up", "--nproc-per-node", "100000"], "--nproc-per-node 100000 must be between 1 and 1024"),
    ("gpus too many", ["up", "--gpus", "5000"], "--gpus 5000: at most 1024 per node"),
    ("host name too long", ["up", "--hosts", "@" + "a" * 300 + "\n"], ":1: host name of 300 characters"),
    ("reserved option", ["up", "--", "--data-dir", "/x"], "set by the orchestrator"),
    ("master port", ["up", "--master-port", "80"], "--master-port 80 out of range"),
    ("image name", ["up", "--image", "Bad Image!"], "is not a valid image name"),
    ("job name", ["up", "--job", "$(id)"], "job name '$(id)' is not allowed"),
    ("env no =", ["up", "--env", "FOO"], "write --env NAME=VALUE"),
    ("env bad name", ["up", "--env", "1X=2"], "not a valid variable name"),
    ("data-from missing", ["up", "--data-from", "{tmp}/no.tar.gz"], "no such file or folder"),
    ("image-from missing", ["up", "--image-from", "{tmp}/no.json"], "no such file; it is the manifest `submit`"),
    ("md5", ["up", "--data-md5", "xyz"], "is not an md5"),
    ("nproc 0", ["up", "--nproc-per-node", "0"], "--nproc-per-node 0 must be between 1 and 1024"),
    ("relative data dir", ["up", "--data-dir", "data"], "must be an absolute path"),
    ("resume+replace", ["up", "--resume", "--replace"], "kill the job first"),
    ("unknown up option", ["up", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("kill grace", ["kill", "--grace", "-1"], "--grace -1.0 must be a number of seconds from 0 to 3600"),
    ("kill grace nan", ["kill", "--grace", "nan"], "--grace nan must be a number of seconds from 0 to 3600"),
    ("up grace inf", ["up", "--grace", "inf"], "--grace inf must be a number of seconds from 0 to 3600"),
    # docker-py's socket timeout overflowed and the container kept running
    ("kill grace 1e12", ["kill", "--grace", "1e12"], "--grace 1000000000000.0 must be a number of seconds from 0 to 3600"),
    ("up grace 1e12", ["up", "--grace", "1e12"], "--grace 1000000000000.0 must be a number of seconds from 0 to 3600"),
    ("min-free-gb nan", ["up", "--min-free-gb", "nan"], "--min-free-gb nan must be a number of GB"),
    ("job name newline", ["up", "--job", "j1\n"], "job name 'j1\\n' is not allowed"),
    ("md5 newline", ["up", "--data-md5", "0" * 32 + "\n"], "is not an md5"),
    ("url newline", ["up", "--data-url", "http://x/a\n"], "is not an http(s) URL"),
    ("duplicate by case", ["up", "--hosts", "@gpu-a\nGPU-A\n"], ":2: duplicate host 'GPU-A'"),
    ("log dir /var/run", ["up", "--log-dir", "/var/run"], "is a system folder"),
    ("ckpt dir /", ["up", "--ckpt-dir", "/"], "is a system folder"),
    ("hosts log_dir=/run", ["up", "--hosts", "@a log_dir=/run\n"], ":1: log_dir is a system folder"),
    ("kill unknown job", ["kill", "--job", "ghost", "--no-hosts"], "no record of job 'ghost'"),
    ("logs node", ["logs", "--node", "-1"], "--node -1 must be a node rank"),
    ("layer cache word", ["up", "--layer-cache", "yes"], "argument --layer-cache: invalid choice: 'yes'"),
    # Echoed values show control characters escaped: the error stays one line.
    ("hosts path with a newline", ["up", "--hosts", "{tmp}/nope\nx"], "hosts file {tmp}/nope\\nx does not exist"),
    ("data-from with an escape", ["up", "--data-from", "{tmp}/a\x1b[2Jb"], "--data-from {tmp}/a\\x1b[2Jb: no such"),
    ("ssh config with a newline", ["up", "--ssh-config", "{tmp}/c\r\nd"], "ssh config {tmp}/c\\r\\nd does not exist"),
    # Lines end at \n only: a form feed or a Unicode line separator inside a line (here in a comment) is no line
    # break, so the error names the line an editor shows.
    *[(f"hosts file with {sep!r} in a line", ["up", "--hosts", f"@a # note{sep}more\nbad;x\n"],
       ":2: bad host name 'bad;x'") for sep in ("\f", "\v", "\x85", "\u2028", "\x1c")],
    # gpu_ids=: ranges bounded before they are expanded (a MemoryError before), none empty (silently dropped before),
    # and a --gpus count that disagrees with the line (N processes on the line's GPUs before).
    ("gpu_ids huge range", ["up", "--dry-run", "--hosts", "@a gpu_ids=0-99999999999999\n"],
     ":1: gpu_ids=0-99999999999999: index 99999999999999 is above 1023"),
    ("gpu_ids empty range", ["up", "--dry-run", "--hosts", "@a gpu_ids=0,3-2\n"], ":1: gpu_ids=0,3-2: range 3-2 is empty"),
    ("gpu_ids and another --gpus", ["up", "--dry-run", "--gpus", "2", "--hosts", "@gpu-a gpu_ids=0\n"],
     ":1: gpu-a lists gpu_ids=0 (1 GPU(s)) but --gpus 2 was given; leave --gpus out"),
    ("gpu_ids and other indices", ["up", "--dry-run", "--gpus", "4-5", "--hosts", "@a\nb gpu_ids=0,1\n"],
     ":2: b lists gpu_ids=0,1 (2 GPU(s)) but --gpus 4,5 was given"),
    # no option is taken by a prefix of its name (argparse's default: a new option could change an old line)
    ("abbreviated up option", ["up", "--dry-run", "--max-restart", "1"], "unrecognized arguments: --max-restart "),
    ("abbreviated kill option", ["kill", "--gra", "5"], "unrecognized arguments: --gra 5"),
    # submit's own options (run() hands submit its whole command line; nothing reaches sbatch)
    ("submit stop-grace negative", ["submit", "--dry-run", "--nodes", "2", "--stop-grace", "-5", "--no-hosts"],
     "--stop-grace -5 must be a number of seconds from 0 to 3600"),
    ("submit stop-grace huge", ["submit", "--dry-run", "--nodes", "2", "--stop-grace", "100000000000000000000", "--no-hosts"],
     "--stop-grace 100000000000000000000 must be a number of seconds from 0 to 3600"),
    ("submit python empty", ["submit", "--dry-run", "--nodes", "2", "--python", "", "--no-hosts"], "--python is empty; give the Python"),
    ("submit gpus-per-node negative", ["submit", "--dry-run", "--nodes", "2", "--gpus-per-node", "-1", "--no-hosts"],
     "--gpus-per-node -1 must be between 0 and 1024"),
    ("submit time word", ["submit", "--dry-run", "--nodes", "2", "--time", "2h", "--no-hosts"], "--time '2h' is not a Slurm time limit"),
    ("submit stray argument", ["submit", "--dry-run", "--nodes", "2", "stray", "--no-hosts"],
     "unexpected argument 'stray'; put trainer options after '--'"),
    ("up memory word", ["up", "--memory", "lots"], "--memory 'lots' is not a size; write e.g. 16g"),
    ("up memory too small", ["up", "--memory", "1m"], "--memory 1m is below Docker's minimum of 6m"),
]


@pytest.mark.parametrize(("argv", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_one_line(argv: list[str], message: str, hosts: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    message = message.replace("{tmp}", str(tmp_path))
    if "--hosts" in argv:
        i = argv.index("--hosts") + 1
        if argv[i].startswith("@"):
            argv[i] = hosts_with(tmp_path, argv[i][1:])
    elif "--no-hosts" in argv:
        argv.remove("--no-hosts")
    else:
        argv[1:1] = ["--hosts", str(hosts)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def test_a_refused_trainer_option_never_shows_a_secrets_value() -> None:
    from orchestrate.config import SSHOptions, UpConfig
    from orchestrate.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        UpConfig.of(ssh=SSHOptions(None, None, False), env=(("API_TOKEN", "s3cr3t-value"),),
                 trainer_args=("--model", "s3cr3t-value"))
    assert "--model '****' is not a model" in str(refused.value) and "s3cr3t" not in str(refused.value)


def test_layer_cache_on_without_docker_registry_is_refused_before_any_host(hosts: Path, capsys: pytest.CaptureFixture[str],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli.main(["up", "--hosts", str(hosts), "--layer-cache", "on"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --layer-cache on: docker-registry is not installed here; install it (Debian: apt-get "
                     "install docker-registry) or use --layer-cache auto"]


def test_an_archive_whose_md5_is_not_the_expected_one_is_refused_here_with_the_md5_to_pass(
        hosts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The synthetic archive sent without --data-md5: before, the image went out and then every node refused the
    archive, each in a line of its own (`... missing or its md5 differs from c58f...`), with no word of the option.
    Another program's single file is not an archive the nodes check: not refused."""
    from orchestrate.config import SSHOptions, UpConfig
    from orchestrate.errors import ConfigError
    archive = tmp_path / "cifar.tar.gz"
    archive.write_bytes(b"synthetic")
    md5 = hashlib.md5(b"synthetic").hexdigest()
    assert cli.main(["up", "--hosts", str(hosts), "--data-from", str(archive)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: --data-from {archive}: its md5 is {md5}, not CIFAR-10's "
                     f"c58f30108f718f92721af3b95e74349a; to send this archive as it is (synthetic data, another copy), "
                     f"pass --data-md5 {md5}"]
    ssh = SSHOptions(None, None, False)
    with pytest.raises(ConfigError, match=f"not --data-md5 {'0' * 32}"):
        UpConfig.of(ssh=ssh, data_from=archive, data_md5="0" * 32)
    UpConfig.of(ssh=ssh, data_from=archive, data_md5=md5)
    UpConfig.of(ssh=ssh, data_from=archive, entry="/app/train.py")
