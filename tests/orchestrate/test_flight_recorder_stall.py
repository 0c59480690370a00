"""The stall report's flight-recorder part on dumps that torch wrote in a real stall: two gloo processes, rank 1
never enters the second all_reduce, rank 0 waits in it until gloo's timeout.

What torch 2.13 (CPU) does with gloo, found by running it: ProcessGroupGloo records every collective in the flight
recorder (TORCH_FR_BUFFER_SIZE; `torch._C._distributed_c10d._dump_fr_trace()` returns the pickle, entries named
"gloo:all_reduce", their state stays "scheduled"), but nothing writes a dump file on a timeout: the file dump
(TORCH_FR_DUMP_TEMP_FILE + rank) is NCCL's watchdog's (TORCH_NCCL_DUMP_ON_TIMEOUT). So here each rank asks torch
for its dump itself, and the test pins that no file appears on its own; that is why `up` looks for dumps only in
GPU jobs (orchestrate/watch/report.py). The watchdog's own file needs NCCL with 2 ranks (2 GPUs), which no test
tier has: what `up` does around it is tested here on a crafted dump (torch's format, plain data): the prefix a GPU
job's containers get (TORCH_FR_DUMP_TEMP_FILE), where a dump written there lands on the node, and the stall
report reading each rank's dump from its own node's log dir.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from kit.net import free_port
from kit.units import SSH, job_specs

from orchestrate.config import UpConfig
from orchestrate.gpuspec import GPUS_ALL
from orchestrate.hosts import Host
from orchestrate.probe.observations import NodeFacts
from orchestrate.watch.health import RankStack, flight_recorder_lines
from orchestrate.watch.report import FR_ENV, _fr_dumps

# One rank of the stall. Rank 0 enters collective #2 alone and gives up after gloo's 3 s timeout; rank 1 (stuck
# elsewhere) takes its dump once rank 0's is written, so both show the state of the stall.
RANK = """
import datetime, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
rank, port, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
# Both ranks have imported torch before either starts the 3 s rendezvous (CI: one import took longer than 3 s under
# load, and the rendezvous timed out before the stall this test is about).
(out / f"imported{rank}").touch()
deadline = time.monotonic() + 60
while not (out / f"imported{1 - rank}").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=3))
dist.all_reduce(torch.ones(2))
if rank == 0:
    try:
        dist.all_reduce(torch.ones(2))
        sys.exit("error: collective #2 completed without rank 1")
    except RuntimeError:
        pass
else:
    deadline = time.monotonic() + 60
    while not (out / "dump0").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
(out / f"dump{rank}.part").write_bytes(_dump_fr_trace())
os.replace(out / f"dump{rank}.part", out / f"dump{rank}")
os._exit(0)  # no destroy_process_group: the peer is gone, a clean shutdown would wait for it
"""


def test_a_real_gloo_stall_names_the_rank_that_never_entered_the_collective(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "torch_fr_")}  # what a GPU job's containers get
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), port, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    assert [proc.returncode for proc in ranks] == [0, 0], outputs
    assert list(tmp_path.glob("torch_fr_*")) == []  # gloo's timeout wrote no dump of its own (see the docstring)
    dumps = {rank: (tmp_path / f"dump{rank}").read_bytes() for rank in (0, 1)}
    assert flight_recorder_lines(dumps) == ["flight recorder of rank 0: last collective #2 gloo:all_reduce scheduled",
                                            "flight recorder of rank 1: last collective #1 gloo:all_reduce scheduled",
                                            "flight recorder: rank(s) 1 never reached collective #2"]


def crafted_dump(newest: int) -> bytes:
    """A dump as NCCL's watchdog writes it (torch's format: a pickle of plain data), collectives 1..newest."""
    return pickle.dumps({"version": "2.4", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                         "entries": [{"record_id": seq - 1, "collective_seq_id": seq, "p2p_seq_id": 0,
                                      "profiling_name": "nccl:all_reduce", "state": "scheduled", "is_p2p": False}
                                     for seq in range(1, newest + 1)]})


class NodeFiles:
    """One node's files as the scheduler reads them (Ranks.read_file): FileNotFoundError when absent."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read_file(self, path: str, timeout: float = 60.0) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]


def test_a_gpu_jobs_dump_is_written_to_the_nodes_log_dir_and_read_from_there_by_the_stall_report() -> None:
    """2 GPU nodes of 2 ranks: torch writes rank r's dump to TORCH_FR_DUMP_TEMP_FILE + str(r) in the container; that
    path is in the mount of the node's log dir, where the report reads each rank's dump through its own node's
    connection. Ranks 0 and 2 dumped (rank 2 behind), rank 1 did not (no dump yet: left out), rank 3's node is
    unreachable. A CPU job gets no prefix: the report looks for no dump."""
    hosts = [Host(name=f"gpu{n}", hostname=f"10.0.0.1{n}", port=22, user="u", slots=None) for n in (1, 2)]
    config = UpConfig.of(ssh=SSH, job="exp1", image="ddp-cifar:latest", gpus=GPUS_ALL)  # type: ignore[arg-type]
    specs = job_specs(config, hosts, "10.0.0.11", [NodeFacts(iface="eth0", gpus=2)] * 2)
    cpu = job_specs(UpConfig.of(ssh=SSH, job="exp1", image="ddp-cifar:latest", gpus=0),  # type: ignore[arg-type]
                    hosts, "10.0.0.11", [NodeFacts("eth0")] * 2)
    assert [FR_ENV in spec.env for spec in cpu] == [False, False]

    def on_node(node: int, rank: int) -> str:
        """Where the dump torch writes for `rank` in node `node`'s container is on that node."""
        spec = specs[node]
        written = spec.env[FR_ENV] + str(rank)
        mount = next(m for m in spec.mounts if written.startswith(m.target.rstrip("/") + "/"))
        assert mount.source == spec.dirs["log"] and not mount.read_only
        return spec.dirs["log"] + written[len(mount.target):]

    nodes = {0: NodeFiles({on_node(0, 0): crafted_dump(3)}), 1: NodeFiles({on_node(1, 2): crafted_dump(2)})}

    def read_file(node: int, path: str, timeout: float) -> bytes:
        """As the scheduler's Ranks.read_file reads node `node`'s file."""
        if node not in nodes:
            raise OSError("unreachable")
        return nodes[node].read_file(path, timeout)

    specs.append(specs[1])  # a third node, unreachable: the others' dumps are still read
    watcher = SimpleNamespace(specs=specs, ranks=SimpleNamespace(read_file=read_file))
    stacks = [RankStack(node, rank, "") for node, rank in ((0, 0), (0, 1), (1, 2), (2, 3))]
    dumps = _fr_dumps(watcher, stacks)  # type: ignore[arg-type]
    assert sorted(dumps) == [0, 2]
    assert flight_recorder_lines(dumps) == ["flight recorder of rank 0: last collective #3 nccl:all_reduce scheduled",
                                            "flight recorder of rank 2: last collective #2 nccl:all_reduce scheduled",
                                            "flight recorder: rank(s) 2 never reached collective #3"]
