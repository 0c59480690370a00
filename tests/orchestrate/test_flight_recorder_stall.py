"""The stall report's flight-recorder part on dumps that torch wrote in a real stall: two gloo processes, rank 1
never enters the second all_reduce, rank 0 waits in it until gloo's timeout.

What torch 2.13 (CPU) does with gloo, found by running it: ProcessGroupGloo records every collective in the flight
recorder (TORCH_FR_BUFFER_SIZE; `torch._C._distributed_c10d._dump_fr_trace()` returns the pickle, entries named
"gloo:all_reduce", their state stays "scheduled"), but nothing writes a dump file on a timeout: the file dump
(TORCH_FR_DUMP_TEMP_FILE + rank) is NCCL's watchdog's (TORCH_NCCL_DUMP_ON_TIMEOUT). So here each rank asks torch
for its dump itself, and the test pins that no file appears on its own; that is why `up` looks for dumps only in
GPU jobs (orchestrate/watch/report.py), and why the dump written by the watchdog is the GPU tier's to test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kit.net import free_port

from orchestrate.watch.health import flight_recorder_lines

# One rank of the stall. Rank 0 enters collective #2 alone and gives up after gloo's 3 s timeout; rank 1 (stuck
# elsewhere) takes its dump once rank 0's is written, so both show the state of the stall.
RANK = """
import datetime, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
rank, port, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
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
