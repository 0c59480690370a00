"""The resume checkpoint relayed inside the cluster (orchestrate/backends/docker_ssh/ckptrelay.py, decided by
plan/relay.py's plan_copy_relay): the node that holds it serves it, the nodes that lack it fetch it, down a tree
past the fan-out; a node that cannot fetch it, or whose copy does not validate, gets it through here with one
line saying why; the dry run says where each node gets it from. The nodes are fakes here; the node-side scripts
(pack, serve, fetch, unpack with the manifest last) run for real at the end of this file. On real hosts:
tests/cluster/test_self_healing.py::test_node_0s_host_cut_off_the_job_finishes_on_the_others_from_the_replica."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kit.lines import LineReader
from kit.units import SSH, plan_inputs

from orchestrate.backends.docker_ssh import checkpoints, ckptrelay, relay, start
from orchestrate.backends.docker_ssh.ckptrelay import land_command
from orchestrate.backends.docker_ssh.relay import RELAY_SCRIPT, Failed, RelayError, Served
from orchestrate.backends.docker_ssh.request import plan_json, render_job_plan
from orchestrate.config import UpConfig
from orchestrate.hosts import Host
from orchestrate.plan.jobplan import Attempt, plan_job
from orchestrate.plan.relay import RelayPlan, plan_copy_relay
from orchestrate.plan.resume import ResumePoint
from orchestrate.probe.observations import Checkpoint, Launcher, NodeFacts
from orchestrate.remote.ssh import Result
from trainer.contract import SHARDED_FORMAT, ckpt_folder_name

CKPT = Checkpoint("h1", "/ck", "ckpt-00000010", 10, 1, False, 30, "", "/ck/ckpt-00000010/manifest.json",
                  (("ckpt-00000010/__0_0.distcp", 10, "aa"), ("ckpt-00000010/__1_0.distcp", 20, "bb")))


def test_the_source_node_serves_the_others_under_the_same_rule_as_the_layers() -> None:
    # the tree counts the node that serves: auto from 3 nodes in all (2 that lack it), on from 2, off never
    assert plan_copy_relay("auto", 1, [0, 2]) == RelayPlan(1, (0, 2), 0, (1, 1))
    assert plan_copy_relay("auto", 1, [0]) == RelayPlan(None) and plan_copy_relay("on", 1, [0]) == RelayPlan(1, (0,), 0,
                                                                                                             (1,))
    assert plan_copy_relay("off", 0, [1, 2, 3]) == RelayPlan(None) and plan_copy_relay("on", 0, []) == RelayPlan(None)
    assert plan_copy_relay("on", 3, range(7)).parents == (3, 3, 3, 3, 0, 0, 0)  # past 4: the first fetcher serves


class Cluster:
    """Fake nodes: `lacking` lack the checkpoint; `unreachable` cannot fetch; `bad_copy` fetch bytes whose copy does
    not validate; `no_pack`: the source node cannot pack it. Records what was served, fetched, copied through here."""

    def __init__(self, n: int, lacking: Sequence[int], unreachable: Sequence[int] = (), bad_copy: Sequence[int] = (),
                 no_pack: bool = False) -> None:
        self.hosts = [SimpleNamespace(label=f"h{i}") for i in range(n)]
        self.lacking, self.unreachable, self.bad_copy, self.no_pack = set(lacking), unreachable, bad_copy, no_pack
        self.served: list[tuple[int, list[str]]] = []
        self.fetched: dict[int, tuple[str, list[str]]] = {}
        self.through_here: list[int] = []

    def conn(self, rank: int) -> Any:
        return SimpleNamespace(rank=rank, host=self.hosts[rank], identity=lambda: SimpleNamespace(home=f"/home/n{rank}"))

    @contextmanager
    def serving_packed(self, conn: Any, folder: str, names: Sequence[str], what: str) -> Iterator[Served]:
        if self.no_pack:
            raise RelayError("the node could not pack them: cannot pack /ck/ckpt-00000010: No space left on device")
        self.served.append((conn.rank, [folder, *names]))
        yield Served(9000 + conn.rank, "t" * 32, 300, "digest")

    def fetch(self, conn: Any, served: Served, address: str, land: list[str], keep: str | None) -> Failed | None:
        self.fetched[conn.rank] = (address, land)
        if conn.rank in self.unreachable:
            return Failed("cannot reach the relay: cannot connect to 10.0.0.1:9001: No route to host", 3)
        if conn.rank not in self.bad_copy:
            self.lacking.discard(conn.rank)
        return None

    def validate(self, conn: Any, folder: str, name: str) -> Checkpoint | None:
        assert name == CKPT.manifest_name and folder == f"/ck{conn.rank}"
        return None if conn.rank in self.lacking else CKPT

    def copy(self, src: Any, ckpt: Checkpoint, dst: Any, folder: str) -> None:
        assert src.rank == 1 and ckpt == CKPT
        self.through_here.append(dst.rank)


def _copy(monkeypatch: pytest.MonkeyPatch, cluster: Cluster, mode: str, copy_to: Sequence[int]) -> list[str]:
    monkeypatch.setattr(ckptrelay, "serving_packed", cluster.serving_packed)
    monkeypatch.setattr(relay, "_fetch", cluster.fetch)
    monkeypatch.setattr(start, "validate", cluster.validate)
    monkeypatch.setattr(ckptrelay, "validate", cluster.validate)
    monkeypatch.setattr(start, "copy_checkpoint", cluster.copy)
    plan = SimpleNamespace(resume=ResumePoint(CKPT, 1, tuple(copy_to)), relay_mode=mode,
                           nodes=[SimpleNamespace(dirs={"ckpt": f"/ck{r}"}) for r in range(len(cluster.hosts))])
    lines: list[str] = []
    start.copy_resume_checkpoint(cluster, plan, lines.append, lambda r: f"10.0.0.{r + 1}")  # type: ignore[arg-type]
    return lines


def test_the_node_that_holds_it_serves_the_nodes_that_lack_it_and_nothing_comes_through_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(4, lacking=(0, 2))
    lines = _copy(monkeypatch, cluster, "on", (0, 2, 3))  # node 3 holds it by now: left alone
    names = ["ckpt-00000010/__0_0.distcp", "ckpt-00000010/__1_0.distcp", "ckpt-00000010/manifest.json"]
    assert cluster.served == [(1, ["/ck", *names])] and cluster.through_here == []  # packed there, the manifest last
    assert cluster.fetched == {r: ("10.0.0.2", land_command(f"/ck{r}", CKPT.manifest_name)) for r in (0, 2)}
    assert sorted(lines) == [f"checkpoint step 10 on h{r}: fetched from the relay on h1, sha256 verified, 0 bytes "
                             "through here" for r in (0, 2)]


def test_a_node_that_cannot_fetch_or_whose_copy_does_not_validate_is_copied_it_through_here_with_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(4, lacking=(0, 2, 3), unreachable=(2,), bad_copy=(3,))
    lines = _copy(monkeypatch, cluster, "auto", (0, 2, 3))
    assert cluster.through_here == [2, 3] and sorted(cluster.fetched) == [0, 2, 3]
    assert sorted(lines)[1:] == [
        "checkpoint step 10 on h2: could not fetch from the relay on h1 (cannot reach the relay: cannot connect to "
        "10.0.0.1:9001: No route to host); copying it through here",
        "checkpoint step 10 on h3: could not fetch from the relay on h1 (the copy does not match its manifest); "
        "copying it through here"]


def test_a_source_node_that_cannot_serve_it_means_every_copy_comes_through_here(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(3, lacking=(0, 2), no_pack=True)
    lines = _copy(monkeypatch, cluster, "on", (0, 2))
    assert cluster.through_here == [0, 2] and cluster.fetched == {}
    assert lines == ["checkpoint step 10: node 1 (h1) could not serve it (the node could not pack them: cannot pack "
                     "/ck/ckpt-00000010: No space left on device); copying it to each node through here"]


def test_under_auto_s_threshold_or_off_the_copies_come_through_here_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    for mode, copy_to in (("auto", (0,)), ("off", (0, 2))):
        cluster = Cluster(3, lacking=copy_to)
        assert _copy(monkeypatch, cluster, mode, copy_to) == []
        assert cluster.through_here == list(copy_to) and cluster.served == [] and cluster.fetched == {}


HOSTS = [Host(name=f"h{i}", hostname=f"10.0.0.{i + 1}", port=22, user="u", slots=None) for i in range(7)]
DIRS = {"data": "/home/u/.cache/ddp-cifar/data", "ckpt": "/home/u/ck", "log": "/home/u/logs"}


def _plan(relay_mode: str, nodes: int, copy_to: tuple[int, ...]):  # type: ignore[no-untyped-def]
    config = UpConfig.of(ssh=SSH, job="p", image="ddp-cifar:cpu", gpus=0, relay=relay_mode)  # type: ignore[arg-type]
    facts = [NodeFacts(iface="eth0", addr=f"10.0.0.{i + 1}", dirs=DIRS, image_id=None, layers_held=5)
             for i in range(nodes)]
    return plan_job(plan_inputs(config, Attempt(0, resume=True), HOSTS[:nodes], "10.0.0.1", facts, launcher=Launcher(),
                                resume=ResumePoint(CKPT, 1, copy_to)))


def test_the_dry_run_says_where_each_node_gets_the_checkpoint_from() -> None:
    text = render_job_plan(_plan("auto", 7, (0, 2, 3, 4, 5, 6)))
    assert ("# resume: step 10 (epoch 1) from node 1:/ck/ckpt-00000010, copied to node(s) 0, 2, 3, 4, 5, 6 inside the "
            "cluster (--relay auto): node 1 serves it to node(s) 0, 2, 3, 4; each node that fetched serves up to 4 more "
            "(a relay tree: each node's line says from which node); a node that cannot fetch it gets it through "
            "here") in text
    assert text.count("#   resume checkpoint: copied from node 1\n") == 4
    assert text.count("#   resume checkpoint: copied from node 0\n") == 2
    assert plan_json(_plan("auto", 7, (0, 2, 3, 4, 5, 6)))["resume"]["copy_from"] == ["node 1"] * 4 + ["node 0"] * 2
    two = _plan("auto", 2, (0,))
    assert "copied to node(s) 0 through here (from its node to this machine to theirs)" in render_job_plan(two)
    assert "#   resume checkpoint: copied from node 1 through here\n" in render_job_plan(two)
    assert plan_json(two)["resume"]["copy_from"] == ["node 1 through here"]


class LocalConn:
    """A node whose commands run on this machine (for backends/docker_ssh/checkpoints.py's validate)."""

    host = SimpleNamespace(label="here")

    def run(self, argv: list[str], timeout: float = 60) -> Result:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return Result(res.returncode, res.stdout, res.stderr)

    def read_file(self, path: str, timeout: float = 60) -> bytes:
        return Path(path).read_bytes()


def _folder(ckpt_dir: Path, step: int) -> Checkpoint:
    """A step folder as trainer/dcp_checkpoint.py seals it (made-up bytes), as validated."""
    where = ckpt_dir / ckpt_folder_name(step)
    where.mkdir(parents=True)
    blobs = {".metadata": b"index", "trainer.pt": b"trainer state", "__0_0.distcp": os.urandom(3 << 20),
             "__1_0.distcp": b"\x01" * 1000}
    for name, blob in blobs.items():
        (where / name).write_bytes(blob)
    files = {n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in blobs.items()}
    (where / "manifest.json").write_text(json.dumps({"format": SHARDED_FORMAT, "strategy": "fsdp", "step": step,
                                                     "epoch": 1, "epoch_complete": False, "world_size": 2,
                                                     "files": files}))
    found = checkpoints.validate(LocalConn(), str(ckpt_dir), f"{ckpt_folder_name(step)}/manifest.json")  # type: ignore[arg-type]
    assert found is not None
    return found


def test_the_scripts_pack_serve_fetch_and_unpack_it_into_a_copy_that_validates(tmp_path: Path) -> None:
    ckpt = _folder(tmp_path / "node0", 10)
    archive, dst = tmp_path / "relay" / "checkpoint.tar", tmp_path / "node1"
    names = [*(name for name, _, _ in ckpt.files), ckpt.manifest_name]
    packed = subprocess.run([sys.executable, "-c", RELAY_SCRIPT, "pack", str(archive), ckpt.folder, *names],
                            capture_output=True, text=True, timeout=60, check=True)
    size, sha256 = packed.stdout.split()
    assert int(size) == archive.stat().st_size and sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()
    server = subprocess.Popen([sys.executable, "-c", RELAY_SCRIPT, "serve", str(archive)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    try:
        server.stdin.write("token\n")
        server.stdin.flush()
        port = LineReader(server.stdout).next(30, "the server's port").split()[1]
        fetched = subprocess.run([sys.executable, "-c", RELAY_SCRIPT, "fetch", "127.0.0.1", port, sha256, size,
                                  str(tmp_path / "in"), *land_command(str(dst), ckpt.manifest_name)],
                                 input="token\n", capture_output=True, text=True, timeout=60)
        assert fetched.returncode == 0, fetched.stderr
    finally:
        server.stdin.close()
        server.wait(30)
    copy = checkpoints.validate(LocalConn(), str(dst), ckpt.manifest_name)  # type: ignore[arg-type]
    assert copy is not None and copy.files == ckpt.files
    assert not archive.exists() and list((tmp_path / "in").iterdir()) == []  # the server and the fetch cleaned up
    assert sorted(p.name for p in dst.iterdir()) == [ckpt.file]  # no staging folder left


def test_an_unpack_cut_short_leaves_no_manifest_so_the_copy_never_counts(tmp_path: Path) -> None:
    """`mv` fails for one shard (a disk gone read-only): the manifest is never renamed into place."""
    ckpt = _folder(tmp_path / "node0", 10)
    names = [*(name for name, _, _ in ckpt.files), ckpt.manifest_name]
    tar = subprocess.run(["tar", "-c", "-C", ckpt.folder, *names], capture_output=True, timeout=60, check=True).stdout
    bin_dir, dst = tmp_path / "bin", tmp_path / "node1"
    bin_dir.mkdir()
    (bin_dir / "mv").write_text('#!/bin/sh\ncase "$*" in *__0_0.distcp*) exit 1;; esac\nexec /bin/mv "$@"\n')
    (bin_dir / "mv").chmod(0o755)
    res = subprocess.run(land_command(str(dst), ckpt.manifest_name), input=tar, capture_output=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert res.returncode != 0
    assert not (dst / ckpt.manifest_name).exists() and [p.name for p in dst.iterdir()] == [ckpt.file]
