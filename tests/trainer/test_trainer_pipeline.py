"""Pipeline parallelism (--pp): the balanced split, the stages cut by name, and the numbers against the unpipelined
model (gloo, CPU, fp32, real processes under torchrun)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit.net import free_port
from kit.trainer_helpers import (
    REPO,
    base_args,
    child_env,
    metrics_lines,
    newest_state,
    run_torchrun,
    step_lines,
    torchrun_cmd,
    unit_cfg,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainer import dcp_checkpoint, models, pipeline
from trainer.__main__ import main
from trainer.config import PP_MODEL_BLOCKS
from trainer.contract import ckpt_folder_name
from trainer.dist import DistContext
from trainer.errors import ConfigError, StagesDoNotFit
from trainer.strategies.pp import PipelineStrategy


def _brute_force(costs: pipeline.StageCosts, stages: int) -> tuple[float, float]:
    """Over every contiguous split (every choice of stages-1 cut points), each stage's cost written out anew:
    the least slowest stage among those whose every stage fits the limit (inf when none does), and the least
    largest stage memory of all."""
    n, fast, small = len(costs.compute_s), float("inf"), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        seconds, memory = [], []
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            sent = 2 * costs.out_bytes[b - 1] / costs.link_bps[s] if s < stages - 1 else 0.0
            received = 2 * costs.out_bytes[a - 1] / costs.link_bps[s - 1] if s > 0 else 0.0
            seconds.append(sum(costs.compute_s[a:b]) + sent + received)
            memory.append(sum(costs.state_bytes[a:b]) + costs.in_flight[s] * sum(costs.saved_bytes[a:b]))
        small = min(small, max(memory))
        if costs.limit_bytes is None or max(memory) <= costs.limit_bytes:
            fast = min(fast, max(seconds))
    return fast, small


def test_the_balanced_split_is_the_brute_force_optimum_and_covers_every_block_once() -> None:
    """Random compute, cut transfers (each cut's bytes over its own link) and memories, with a memory limit that
    binds in about half the cases and leaves no split in some: the dynamic program's split is the brute force's,
    or both find none and the refusal carries the least largest stage's need."""
    rng = random.Random(42)
    refused = bound = 0
    for _ in range(400):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = pipeline.StageCosts(
            [rng.choice([rng.random(), rng.random() * 10, 1.0]) for _ in range(n)],
            [rng.choice([0.0, rng.random() * 4]) for _ in range(n)], [rng.uniform(0.5, 2) for _ in range(stages - 1)],
            [rng.random() for _ in range(n)], [rng.random() for _ in range(n)],
            [rng.randint(1, 4) for _ in range(stages)])
        unbounded_s, least_need = _brute_force(costs, stages)
        limit = rng.choice([None, least_need * rng.uniform(0.8, 1.6)])
        costs = dataclasses.replace(costs, limit_bytes=limit)
        fast, _ = _brute_force(costs, stages)
        if fast == float("inf"):
            refused += 1
            with pytest.raises(StagesDoNotFit) as refusal:
                pipeline.balanced_split(costs, stages)
            assert (refusal.value.need, refusal.value.limit) == (pytest.approx(least_need), limit)
            continue
        bound += fast > unbounded_s
        split = pipeline.balanced_split(costs, stages)
        assert len(split) == stages and min(split) >= 1 and sum(split) == n
        assert sorted(i for run in pipeline.stage_blocks(split) for i in run) == list(range(n))
        assert max(costs.per_stage(split, costs.seconds)) == pytest.approx(fast, rel=1e-12)
        assert limit is None or max(costs.per_stage(split, costs.bytes)) <= limit
    assert refused > 20 and bound > 20  # both kinds of case are drawn


# resnet20-gn's block outputs at a micro-batch of 8 images, fp32: 16x32x32, 32x16x16, 64x8x8 channels x pixels
RESNET20_OUT_BYTES = [8 * 16 * 32 * 32 * 4] * 3 + [8 * 32 * 16 * 16 * 4] * 3 + [8 * 64 * 8 * 8 * 4] * 3


def test_a_cut_that_sends_twice_the_bytes_moves_the_split() -> None:
    """The case bench/pipeline.py met: resnet20-gn's blocks timed so that, by compute alone, [3, 6] (18.0 and 18.6
    ms) beats [4, 5] (18.9, 17.7); but a cut after block 3 sends 16x32x32 per image, twice a cut after block 4.
    At 1 GB/s (gloo on one host measured about that) the transfers make [4, 5] the faster."""
    compute_ms = [6.0, 6.0, 6.0, 0.9, 3.5, 3.5, 3.5, 3.6, 3.6]
    costs = pipeline.StageCosts([c / 1000 for c in compute_ms], RESNET20_OUT_BYTES, [1e9])
    assert pipeline.balanced_split(costs.compute_s, 2) == [3, 6]
    assert pipeline.balanced_split(costs, 2) == [4, 5]
    assert costs.per_stage([3, 6], costs.transfer_s) == pytest.approx([2 * 524288 / 1e9] * 2)


def test_the_split_keeps_every_stage_within_the_devices_memory_or_is_refused_with_the_need() -> None:
    """Four blocks of equal time; the first keeps 3 bytes of activations per micro-batch, the others 1. Under 1F1B
    stage 0 holds 2 micro-batches, stage 1 one: [2, 2] (the fastest) needs 8, [1, 3] 6. Under a limit of 7 the split
    is [1, 3]; under 5 none fits, and the refusal says the least largest stage's need (6) and the limit."""
    assert pipeline.in_flight("1f1b", 4, 16) == [4, 3, 2, 1]
    assert pipeline.in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert pipeline.in_flight("gpipe", 2, 8) == [8, 8]
    costs = pipeline.StageCosts([1.0] * 4, state_bytes=[0.0] * 4, saved_bytes=[3.0, 1.0, 1.0, 1.0],
                                in_flight=pipeline.in_flight("1f1b", 2, 8))
    assert pipeline.balanced_split(costs, 2) == [2, 2]
    assert costs.per_stage([2, 2], costs.bytes) == [8.0, 2.0]
    assert pipeline.balanced_split(dataclasses.replace(costs, limit_bytes=7.0), 2) == [1, 3]
    with pytest.raises(StagesDoNotFit) as refusal:
        pipeline.balanced_split(dataclasses.replace(costs, limit_bytes=5.0), 2)
    assert (refusal.value.need, refusal.value.limit, refusal.value.stages) == (6.0, 5.0, 2)
    assert isinstance(refusal.value, ConfigError) and "\n" not in str(refusal.value)  # one error line, exit 2


def test_the_measured_auto_split_of_a_resnet_beats_the_uniform_one() -> None:
    """On this CPU a CIFAR ResNet's early blocks (32x32, 16 channels) cost more than its late ones (8x8): the split
    of the measured costs is never worse than the uniform one. By how much it is better is bench/pipeline.py's figure:
    under the test suite's load the measured costs were once even enough that both splits tied (0.0234 s each).
    The profile's bytes are the blocks' real ones: their outputs' shapes, every parameter once, some activations."""
    torch.manual_seed(0)
    model = models.build("resnet20-gn")
    measured = pipeline.profile(model, 8, torch.device("cpu"), warmup=1, reps=3)
    costs = measured.seconds
    assert len(costs) == PP_MODEL_BLOCKS["resnet20-gn"] and min(costs) > 0
    assert measured.out_bytes == RESNET20_OUT_BYTES
    assert sum(measured.param_bytes) == sum(p.numel() * 4 for p in model.parameters())
    assert min(measured.saved_bytes) >= RESNET20_OUT_BYTES[-1]  # each block keeps at least its input for backward
    auto = max(pipeline.stage_cost(costs, pipeline.balanced_split(costs, 2)))
    uniform = max(pipeline.stage_cost(costs, pipeline.uniform_split(len(costs), 2)))
    assert auto <= uniform


def test_the_first_log_line_says_the_split_each_stages_cost_with_its_transfers_its_memory_and_the_bubble() -> None:
    strategy = PipelineStrategy(unit_cfg(model="resnet20-gn", pp=2, batch_size=8))
    strategy.split = [4, 5]
    strategy.costs = pipeline.StageCosts([0.004] * 9, RESNET20_OUT_BYTES, [524288e3], [2**20] * 9, [2**20] * 9,
                                         [2, 1], 3 * 2**30)
    assert strategy.describe() == (
        "pipeline: 2 stages x 1 replicas (1f1b, 8 micro-batches), split [4, 5] blocks (auto), stage costs 17.0 21.0 "
        "ms, of which transfers 1.0 1.0 ms, memory 0.01 0.01 GiB of 3.00, bubble 11.1%")


@pytest.mark.parametrize("name", sorted(PP_MODEL_BLOCKS))
def test_stages_hold_the_full_models_names_disjoint_and_complete(name: str) -> None:
    torch.manual_seed(0)
    model = models.build(name)
    blocks = PP_MODEL_BLOCKS[name]
    assert len(pipeline.blocks_of(model)) == blocks  # the torch-free table the parser refuses by
    split = pipeline.balanced_split([1.0 + (i % 3) for i in range(blocks)], 4)
    parts = pipeline.cut(model, split, range(4))
    names = [{n for n, _ in part.state_dict().items()} for part in parts]
    assert all(not (a & b) for a, b in itertools.combinations(names, 2))
    assert set().union(*names) == set(model.state_dict())
    assert set(pipeline.merged([parts[0], parts[2]]).state_dict()) == names[0] | names[2]


def test_the_stages_in_a_row_compute_the_full_model() -> None:
    torch.manual_seed(0)
    model = models.build("resnet20-gn")
    x = torch.randn(2, 3, 32, 32)
    out = x
    for part in pipeline.cut(model, [2, 4, 3], range(3)):
        out = part(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def _numerics(tmp_path: Path, world: int) -> list[list[dict]]:
    """pp_numerics_worker.py's `world` ranks (forked by it: no torchrun start of 2 s per process): each rank's
    cases, in order."""
    worker = [sys.executable, str(REPO / "tests" / "trainer" / "pp_numerics_worker.py"), str(tmp_path / "rank"),
              str(world)]
    proc = subprocess.run(worker, cwd=REPO, env={**child_env(), "MASTER_PORT": str(free_port())}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [[json.loads(line) for line in (tmp_path / f"rank.{r}").read_text().splitlines()] for r in range(world)]


def _assert_unpipelined_numbers(numeric: list[list[dict]]) -> None:
    """Every case: the replicas' mean loss is the reference's, every gradient and the accuracy match; the stages'
    names are disjoint and complete; an auto split is one decision (every rank's the same, its links measured)."""
    for same_case in zip(*numeric, strict=True):
        name = same_case[0]["case"]
        # Each replica's loss is its share of the batch; their mean is the whole batch's.
        mean_loss = sum(c["loss"] for c in same_case) / len(same_case)
        assert mean_loss == pytest.approx(same_case[0]["ref_loss"], rel=1e-5, abs=4e-5), (name, same_case)
        assert all(c["grads_close"] for c in same_case), (name, [c["grad_err"] for c in same_case])
        assert all(c["acc"] == c["ref_acc"] for c in same_case), name
        assert 0.2 < same_case[0]["ref_acc"] < 0.8  # labels half right: a count that can be wrong either way
        stages: dict[int, set[str]] = {c["pp_rank"]: set(c["names"]) for c in same_case}
        assert all(not (a & b) for a, b in itertools.combinations(stages.values(), 2)), name
        assert set().union(*stages.values()) == set(same_case[0]["full_names"]), name
        assert all((c["split"], c["links"]) == (same_case[0]["split"], same_case[0]["links"]) for c in same_case)
        links = same_case[0]["links"]
        assert links is None or (len(links) == len(same_case[0]["split"]) - 1 and all(0 < b < 1e13 for b in links))


@pytest.mark.slow
def test_every_schedule_gives_the_unpipelined_loss_gradients_accuracy_and_checkpoints(tmp_path: Path) -> None:
    """4 processes: resnet20-gn at pp2 x dp2 (1f1b, gpipe, interleaved split by auto; DDP and FSDP inside the
    stages) and pp4 x dp1 (1f1b, gpipe), vit-cifar (narrowed, pp_numerics_worker.py) at pp2 x dp2 (1f1b, gpipe,
    interleaved) and pp4 x dp1 (interleaved: 8 stages), one step each against the unpipelined model on the same
    global batch (vit-cifar and pp4 gpipe with 1 image per process: pp micro-batches); then a checkpoint saved at pp2 x dp2
    resumed at pp1 (FSDP over 4, DDP over 4) and at pp2 x dp2 (whose next step's loss equals the live run's), one
    saved at pp1 (FSDP's folder, DDP's .pt) resumed at pp2 x dp2, and DDP's .pt resumed by FSDP over 4 (which then
    steps). Last, a loss curve (resnet20-gn is enough: the schedules' numbers on vit-cifar are the one-step cases'):
    20 steps of the strategies' train_step, pp2 x dp2 with each schedule and DDP over the 4 processes, from the same
    weights on the same global batches, every step's loss within 1e-4 relative (the one-step cases run at lr 0: only
    this sees the optimizer's side, momentum and weight decay, and a second step: before DDP inside a stage looked
    for unused parameters, GPipe and interleaved failed there in DDP's bucket rebuild, "36 versus rebuilt params size
    of: 72")."""
    per_rank = _numerics(tmp_path, 4)
    numeric = [[c for c in cases if not c["case"].startswith(("ckpt", "curve"))] for cases in per_rank]
    assert [c["case"] for c in numeric[0]] == ["pp2-1f1b-ddp", "pp2-gpipe-ddp", "pp2-interleaved-ddp",
                                               "pp4-1f1b-ddp", "pp2-1f1b-fsdp", "vit-cifar-pp2-1f1b-ddp",
                                               "vit-cifar-pp2-gpipe-ddp", "vit-cifar-pp2-interleaved-ddp",
                                               "pp4-gpipe-ddp", "vit-cifar-pp4-interleaved-ddp"]
    assert [c["links"] is not None for c in numeric[0]] == [False, False, True] + [False] * 7
    _assert_unpipelined_numbers(numeric)
    for cases in per_rank:  # 20 steps: the loss curve of pp2 x dp2 is DDP's over the 4 processes
        curve = cases[-1]
        assert curve["case"] == "curve-pp2-vs-ddp"
        for schedule in ("1f1b", "gpipe", "interleaved"):
            pipelined = curve[f"pp2-{schedule}"]
            assert len(pipelined) == 20 and pipelined == pytest.approx(curve["ddp"], rel=1e-4), (schedule, curve)
        assert abs(curve["ddp"][-1] - curve["ddp"][0]) > 0.05  # it trained: a curve, not 20 times the first step
    for cases in per_rank:
        moved = {c["case"]: c for c in cases if c["case"].startswith("ckpt")}
        assert sorted(moved) == ["ckpt-pp1-to-pp1-ddp-to-fsdp", "ckpt-pp1-to-pp2-ddp", "ckpt-pp1-to-pp2-fsdp",
                                 "ckpt-pp2-to-pp1-ddp", "ckpt-pp2-to-pp1-fsdp", "ckpt-pp2-to-pp2-ddp"]
        for c in moved.values():
            assert c["same_keys"] and c["equal"], c
            assert c["position"] == [0, 8, 1, 8]  # epoch, samples of the epoch (global), step, global batch
        assert moved["ckpt-pp2-to-pp2-ddp"]["same_next_loss"] is True


@pytest.mark.slow
def test_pp2_on_2_processes_gives_the_unpipelined_loss_gradients_and_accuracy(tmp_path: Path) -> None:
    """2 processes, one replica (pp2 x dp1: no data parallelism inside the stages, the layout of `up -- --pp 2` on
    2 one-process nodes): 1f1b, gpipe and interleaved, one step each against the unpipelined model."""
    numeric = _numerics(tmp_path, 2)
    assert [c["case"] for c in numeric[0]] == ["pp2-1f1b-ddp", "pp2-gpipe-ddp", "pp2-interleaved-ddp"]
    assert sorted(c["pp_rank"] for c in (cases[0] for cases in numeric)) == [0, 1]
    _assert_unpipelined_numbers(numeric)


@pytest.mark.slow
def test_pp4_x_dp2_gives_the_unpipelined_loss_gradients_and_accuracy(tmp_path: Path) -> None:
    """8 processes (4 stages x 2 replicas, the split by auto: 3 links measured), one 1F1B step against the
    unpipelined model on the same global batch of 16 images."""
    numeric = _numerics(tmp_path, 8)
    assert [c["case"] for c in numeric[0]] == ["pp4-1f1b-ddp"]
    assert sorted(c["pp_rank"] for c in (cases[0] for cases in numeric)) == [0, 0, 1, 1, 2, 2, 3, 3]
    _assert_unpipelined_numbers(numeric)


def _folder_state(folder: Path, tmp: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A DCP checkpoint's full weights and momentum buffers by parameter name, read without a process group."""
    out = tmp / f"{folder.name}-{len(list(tmp.glob('*.full')))}.full"
    dcp_to_torch_save(folder, out)
    saved = torch.load(out, weights_only=True)
    return saved["model"], {k: v["momentum_buffer"] for k, v in saved["optim"]["state"].items()}


def _pt_state(ckpt: Path, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The newest .pt's weights and momentum buffers by parameter name (its optimizer state is keyed by index)."""
    saved = newest_state(ckpt)
    return saved["model"], {names[i]: v["momentum_buffer"] for i, v in saved["optimizer"]["state"].items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ, or are in one only."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.slow
def test_a_pp2_checkpoint_moves_to_ddp_fsdp_and_pp_and_a_killed_stage_restarts_from_it(data_dir: Path, tmp_path: Path,
                                                                                   inprocess: None) -> None:
    """`torchrun -m trainer --pp 2` end to end (the split line, rank 0's loss from the last stage, the schedule's
    evaluation, a sharded checkpoint) against one process on the same global batch (the same images, learning rate
    and initial weights: the losses equal), then its checkpoint walks the strategies (DDP and FSDP on 1 process,
    --pp on 2). A resume at --max-steps 2 loads the step-2 checkpoint and saves it again in its own format without a
    step: DDP's .pt
    holds the pp folder's weights and momentum bitwise, FSDP's folder the .pt's (each time the older format is
    moved away, so the next resume reads the new one). Last, --pp 2 at split [3, 6] resumes FSDP's folder, and
    a stage's process is SIGKILLed inside step 3 (tests/trainer/stage_kill_worker.py): the job fails with nothing of
    that step saved, and the resume `up --max-restarts` would run takes the newest checkpoint (FSDP's, step 2) and
    takes step 3 as one process does: its loss and weights (momentum came through: it moves the weights).
    (Torchrun's own --max-restarts does not: its second attempt's process group fails to connect.)"""
    ckpt, full, names = tmp_path / "c", tmp_path / "full", [n for n, _ in models.build("resnet20-gn").named_parameters()]
    full.mkdir()
    common = [*base_args(data_dir, ckpt, "--batch-size", "8"), "--model", "resnet20-gn"]
    proc = subprocess.run(torchrun_cmd(2, [*common, "--max-steps", "2", "--pp", "2", "--pp-split", "uniform"]),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline: 2 stages x 1 replicas (1f1b, 8 micro-batches), split [5, 4] blocks (uniform)" in proc.stderr
    assert "bubble 11.1%" in proc.stderr
    alone = tmp_path / "alone"
    assert main([*base_args(data_dir, alone, "--max-steps", "3", "--batch-size", "16"), "--model", "resnet20-gn"]) == 0
    alone_losses = [r["loss"] for r in step_lines(alone)]
    assert [r["loss"] for r in step_lines(ckpt)] == pytest.approx(alone_losses[:2], rel=1e-4)
    pp_folder = ckpt / ckpt_folder_name(2)
    pp_saved = _folder_state(pp_folder, full)

    def resume(*extra: str) -> None:
        proc = run_torchrun(2, [*common, "--resume", *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]

    # pp -> DDP, on one process (the same global batch): the folder read without the pipeline's process group
    assert main([*base_args(data_dir, ckpt, "--batch-size", "16"), "--model", "resnet20-gn", "--resume",
                 "--max-steps", "2"]) == 0
    ddp_saved = _pt_state(ckpt, names)
    assert _equal(ddp_saved[0], pp_saved[0]) == [] and _equal(ddp_saved[1], pp_saved[1]) == []
    shutil.move(pp_folder, tmp_path / "pp-folder")
    # DDP -> FSDP, on one process (FSDP's shards over 4 take a .pt in pp_numerics_worker.py)
    assert main([*base_args(data_dir, ckpt, "--batch-size", "16"), "--model", "resnet20-gn", "--resume",
                 "--max-steps", "2", "--strategy", "fsdp"]) == 0
    fsdp_saved = _folder_state(pp_folder, full)
    assert _equal(fsdp_saved[0], ddp_saved[0]) == [] and _equal(fsdp_saved[1], ddp_saved[1]) == []
    for pt in ckpt.glob("ckpt-*.*"):  # the .pt and its manifest
        pt.unlink()
    pipelined = ("--max-steps", "3", "--pp", "2", "--pp-split", "3,6")  # FSDP -> pp at another split
    killed = subprocess.run(torchrun_cmd(2, [*common, "--resume", *pipelined, "--dist-timeout", "30"],
                                         entry=(str(Path(__file__).with_name("stage_kill_worker.py")),)),
                            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert killed.returncode != 0 and "exitcode: -9" in killed.stderr, killed.stderr[-3000:]
    newest = dcp_checkpoint.newest_valid(ckpt)
    assert newest is not None and newest.manifest.step == 2  # nothing of the killed step counts
    resume(*pipelined)  # what `up --max-restarts` runs on a restart
    resumes = [r["step"] for r in metrics_lines(ckpt) if r.get("event") == "resume"]
    assert resumes[-2:] == [2, 2]  # the killed attempt's, then the restart's: from the newest checkpoint
    assert [r["step"] for r in step_lines(ckpt)] == [1, 2, 3]
    assert [r["loss"] for r in step_lines(ckpt)][-1] == pytest.approx(alone_losses[2], rel=1e-4)
    _assert_as_alone(_folder_state(ckpt / ckpt_folder_name(3), full)[0], newest_state(alone)["model"])


def _assert_as_alone(weights: dict[str, torch.Tensor], alone: dict[str, torch.Tensor]) -> None:
    """The pipelined run's weights are the single process's, but for float sums in another order (1e-5 holds
    after 3 steps); momentum lost on the way would move them by about 1e-3."""
    assert weights.keys() == alone.keys()
    for name, tensor in weights.items():
        assert torch.allclose(tensor, alone[name], atol=1e-5), name


def test_keep_global_batch_is_refused_only_where_the_micro_batches_do_not_divide() -> None:
    """A restart on 4 processes of a pp2 job: 2 replicas; --keep-global-batch gives each process the saved global
    batch / 4, so a replica takes twice that, in the schedule's 8 micro-batches."""
    strategy = PipelineStrategy(unit_cfg(model="resnet20-gn", pp=2, batch_size=8))
    strategy.dp = 2  # as build() makes it on 4 processes
    ctx = DistContext(0, 0, 4, torch.device("cpu"))
    strategy.check_batch(ctx, 8)  # 16 images per replica: 8 micro-batches of 2
    with pytest.raises(ConfigError, match="each of the 2 replicas would take 12 images per step, not divisible by "
                                          "--pp-microbatches 8"):
        strategy.check_batch(ctx, 6)
