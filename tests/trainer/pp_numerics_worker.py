"""Run under torchrun (`pp_numerics_worker.py OUT`) or as one process that forks the ranks (`OUT WORLD`; gloo,
CPU, fp32): for each pipeline layout this world allows and each schedule, on resnet20-gn and (at 4 processes)
vit-cifar, one step of the trainer's PipelineStrategy against the unpipelined model on the same global batch. Each
rank appends one JSON line per case to ARGV1.RANK: the loss and gradient errors, the accuracies, this stage's
parameter names; at 4 processes also the checkpoint moves and 20 steps' losses of pp2 x dp2 and of DDP."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainer import checkpoint, loop, models, strategies
from trainer.__main__ import exit_without_finalizing
from trainer.config import Config
from trainer.data import Split, normalize
from trainer.dist import DistContext
from trainer.snapshot import save_sharded, to_checkpoint
from trainer.state import Position, TrainState
from trainer.strategies.pp import PipelineStrategy

# vit-cifar's architecture (its 8 blocks, stem and head, the stages cut as in a run) at width 64 instead of 512:
# the same code under pipelining for 1/60 of its parameters (full width, every rank's reference forward of the 23
# test images alone would be 300 GFLOP a case on 2 cores).
models.OWN_MODELS["vit-cifar"] = functools.partial(models.CifarViT, dim=64, heads=4)
BATCH = 2  # per process: each replica takes BATCH x pp images, 2 x pp micro-batches of 1 image
N_TEST = 23  # uneven over the replicas and over the evaluation batches: the padding is exercised


def cases(world: int) -> list[tuple[str, int, str, str, str, int]]:
    """(model, pp, schedule, --strategy inside the stage, --pp-split, images per process). Interleaved and pp4 x
    dp2 split by `auto`: its measurements (the blocks' profile, every pair of neighbouring stages' link, pp2's two
    links on one pair) and its decision sent from rank 0 run in these real processes. vit-cifar and pp4's gpipe
    and interleaved take 1 image per process: pp micro-batches of 1 image per replica, the fewest 1F1B takes."""
    if world == 8:  # pp4 x dp2, one schedule: the others' code is the same (the pp2 x dp2 cases)
        return [("resnet20-gn", 4, "1f1b", "ddp", "auto", BATCH)]
    out = [("resnet20-gn", 2, s, "ddp", "auto" if s == "interleaved" else "uniform", BATCH)
           for s in ("1f1b", "gpipe", "interleaved")]
    if world == 4:  # pp4 x dp1 and FSDP inside the stages, at 3-4 s a case on 2 cores
        out += [("resnet20-gn", 4, "1f1b", "ddp", "uniform", BATCH), ("resnet20-gn", 2, "1f1b", "fsdp", "uniform", BATCH)]
        out += [("vit-cifar", 2, s, "ddp", "uniform", 1) for s in ("1f1b", "gpipe", "interleaved")]
        out += [("resnet20-gn", 4, "gpipe", "ddp", "uniform", 1), ("vit-cifar", 4, "interleaved", "ddp", "uniform", 1)]
    return out


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # type: ignore[union-attr]
            for n, p in model.named_parameters()}


def one_case(ctx: DistContext, name: str, pp: int, schedule: str, inside: str, split: str, batch: int,
             test: Split) -> dict[str, object]:
    cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), model=name, precision="fp32",
                 batch_size=batch, pp=pp, pp_schedule=schedule, pp_microbatches=batch * pp, pp_split=split,
                 strategy=inside, momentum=0.0, weight_decay=0.0)
    gen = torch.Generator().manual_seed(25)
    x = torch.randn(batch * ctx.world_size, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch * ctx.world_size,), generator=gen)
    reference = models.for_run(cfg)
    # Micro-batches of the pipeline's size (1 image), averaged: the same gradient as the whole batch's, with the
    # same conv shapes, so no ReLU input within float error of 0 flips between the two (the whole batch at once
    # did flip one, for a gradient error of 1.6e-3 at seed 25).
    ref_loss = torch.stack([F.cross_entropy(reference(xs), ys) for xs, ys in zip(x.split(1), y.split(1),
                                                                                   strict=True)]).mean()
    ref_loss.backward()
    strategy = PipelineStrategy(cfg)
    st = strategy.build(cfg, ctx)
    share, shares = strategy.data_share(ctx)
    rows = slice(share * batch * pp, (share + 1) * batch * pp)  # TrainLoader's part of the global batch
    loss = strategy.train_step(st, x[rows], y[rows], 0.0, "fp32", 0, contextlib.nullcontext)
    ref = dict(reference.named_parameters())
    grads = full_grads(st.model)
    err = max(float((g - ref[n].grad).abs().max()) for n, g in grads.items())  # type: ignore[operator]
    close = all(torch.allclose(g, ref[n].grad, rtol=1e-5, atol=4e-5) for n, g in grads.items())  # type: ignore[arg-type]
    acc = strategy.evaluate(st, test, ctx, "fp32", 500)
    ref_acc = loop.evaluate(reference, test, DistContext(0, 0, 1, ctx.device), "fp32", 500)
    prefix = "" if name == "resnet20-gn" else f"{name}-"
    return {"case": f"{prefix}pp{pp}-{schedule}-{inside}", "loss": float(loss), "ref_loss": float(ref_loss.detach()),
            "grad_err": err, "grads_close": close, "acc": acc, "ref_acc": ref_acc,
            "names": sorted(grads), "full_names": sorted(ref), "pp_rank": strategy.pp_rank, "split": strategy.split,
            "links": None if strategy.costs is None else list(strategy.costs.link_bps)}


def full_state(st: TrainState, gather: bool) -> dict[str, torch.Tensor]:
    """Every parameter and its momentum by full name (gathered from every stage with `gather`)."""
    model_sd, optim_sd = get_state_dict(st.model, st.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    mine = {**{f"w:{k}": v for k, v in model_sd.items()},
            **{f"m:{k}": v["momentum_buffer"] for k, v in optim_sd["state"].items()}}
    if not gather:
        return mine
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def checkpoint_case(ctx: DistContext, folder: Path, save_pp: int, load_pp: int, inside: str,
                    load_inside: str) -> dict[str, object]:
    """One step at save_pp, a save (a DCP folder, or DDP's .pt at pp1 under ddp), a resume at load_pp (at pp1 under
    load_inside): weights and momentum bitwise equal."""
    def cfg(pp: int, strategy: str) -> Config:
        return Config(data_dir=Path("/unused"), ckpt_dir=folder, model="resnet20-gn", precision="fp32",
                      batch_size=BATCH, pp=pp, pp_microbatches=2 * pp, pp_split="uniform",
                      strategy=strategy if pp == 1 else "ddp")
    before_cfg, after_cfg = cfg(save_pp, inside), cfg(load_pp, load_inside)
    saver = strategies.for_config(before_cfg)
    st = saver.build(before_cfg, ctx)
    saver.wrap(before_cfg, ctx, st)
    share, shares = saver.data_share(ctx)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH * ctx.world_size, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (BATCH * ctx.world_size,), generator=gen)
    rows = slice(share * len(y) // shares, (share + 1) * len(y) // shares)
    saver.train_step(st, x[rows], y[rows], 0.1, "fp32", 0, contextlib.nullcontext)
    st.pos = Position(0, len(y), 1)
    if saver.sharded_checkpoints:
        save_sharded(before_cfg, ctx, st, len(y))
    elif ctx.is_main:  # as the loop's synchronous save writes it
        checkpoint.check_writable(folder)
        checkpoint.save(folder, to_checkpoint(before_cfg, ctx, st, len(y)), step=1, epoch=0, epoch_complete=False,
                        world_size=ctx.world_size, keep=1)
    dist.barrier()
    saved = full_state(st, gather=save_pp > 1)
    loader = strategies.for_config(after_cfg)
    resumed = loader.build(after_cfg, ctx)
    global_batch = loader.restore(after_cfg, ctx, resumed)
    loaded = full_state(resumed, gather=load_pp > 1)
    # The same layout takes its next step twice: from the live state and from the resumed one (an optimizer group
    # restored without its settings fails here, not in the comparison above).
    same_next = None
    if save_pp == load_pp > 1:
        loader.wrap(after_cfg, ctx, resumed)
        live = saver.train_step(st, x[rows], y[rows], 0.1, "fp32", 0, contextlib.nullcontext)
        again = loader.train_step(resumed, x[rows], y[rows], 0.1, "fp32", 0, contextlib.nullcontext)
        same_next = torch.equal(live, again)
    elif load_inside != inside:  # the resumed optimizer steps (a .pt's fused=True would fail on FSDP's DTensors)
        loader.wrap(after_cfg, ctx, resumed)
        loader.train_step(resumed, x[rows], y[rows], 0.1, "fp32", 0, contextlib.nullcontext)
    moved = f"-to-{load_inside}" if load_inside != inside else ""
    return {"case": f"ckpt-pp{save_pp}-to-pp{load_pp}-{inside}{moved}", "same_keys": sorted(saved) == sorted(loaded),
            "equal": all(torch.equal(saved[k], loaded[k]) for k in saved if k in loaded),
            "position": [resumed.pos.epoch, resumed.pos.sample, resumed.pos.step, global_batch],
            "same_next_loss": same_next}


CURVE_STEPS, CURVE_LR = 20, 0.05
# Every schedule's curve: one step each is the one-step cases'; a second step is where DDP inside a stage failed
# under GPipe and interleaved (and 1F1B with 2 micro-batches): two backwards in a row before the first step's end
# recorded each parameter twice for DDP's bucket rebuild (reducer.cpp: "36 versus rebuilt params size of: 72").
CURVE_LAYOUTS = (("pp2-1f1b", 2, "1f1b"), ("pp2-gpipe", 2, "gpipe"), ("pp2-interleaved", 2, "interleaved"),
                 ("ddp", 1, "1f1b"))


def curve_case(ctx: DistContext, batch: int = 2) -> dict[str, object]:
    """A loss curve: CURVE_STEPS optimizer steps of the trainer's own train_step (the strategy objects, momentum and
    weight decay as configured by default) under pp2 x dp2 with each schedule and under DDP over the 4 ranks, each from the same
    seeded initial weights on the same global batches of 4 x `batch` images. Every forward sees 1 image: the
    pipeline's micro-batches and DDP's gradient accumulation (`micro` 1). Each step's loss as the loop reports it
    (the global batch's mean)."""
    gen = torch.Generator().manual_seed(7)
    size = batch * ctx.world_size
    batches = [(torch.randn(size, 3, 32, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen))
               for _ in range(CURVE_STEPS)]
    curves: dict[str, list[float]] = {}
    for layout, pp, schedule in CURVE_LAYOUTS:
        cfg = Config(data_dir=Path("/unused"), ckpt_dir=Path("/unused"), model="resnet20-gn", precision="fp32",
                     batch_size=batch, pp=pp, pp_microbatches=batch * pp, pp_split="uniform", pp_schedule=schedule)
        strategy = strategies.for_config(cfg)
        st = strategy.build(cfg, ctx)
        strategy.wrap(cfg, ctx, st)
        share, shares = strategy.data_share(ctx)
        curve = []
        for x, y in batches:
            rows = slice(share * size // shares, (share + 1) * size // shares)
            loss = strategy.train_step(st, x[rows], y[rows], CURVE_LR, "fp32", 1, contextlib.nullcontext).clone()
            dist.all_reduce(loss)  # the replicas' mean (a pipeline's ranks all hold their replica's loss)
            curve.append(float(loss) / ctx.world_size)
        curves[layout] = curve
    return {"case": "curve-pp2-vs-ddp", **curves}


def half_right(name: str) -> Split:
    """N_TEST images whose labels `name`'s initial model gets right for about half: an accuracy far from 0 and 1
    to match."""
    gen = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (N_TEST, 3, 32, 32), generator=gen, dtype=torch.uint8)
    with torch.no_grad():
        predicted = models.for_run(Config(data_dir=Path("/u"), ckpt_dir=Path("/u"), model=name))(
            normalize(images)).argmax(dim=1)
    return Split(images, torch.where(torch.arange(N_TEST) % 2 == 0, predicted, (predicted + 1) % 10))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, rank, world, torch.device("cpu"), world)
    tests = {name: half_right(name) for name in sorted({c[0] for c in cases(world)})}
    with open(f"{sys.argv[1]}.{rank}", "w") as out:
        for name, pp, schedule, inside, split, batch in cases(world):
            out.write(json.dumps(one_case(ctx, name, pp, schedule, inside, split, batch, tests[name])) + "\n")
            out.flush()
        if world == 4:
            for save_pp, load_pp, inside, load_inside in ((2, 1, "fsdp", "fsdp"), (1, 2, "fsdp", "fsdp"),
                                                          (1, 2, "ddp", "ddp"), (2, 2, "ddp", "ddp"),
                                                          (2, 1, "ddp", "ddp"), (1, 1, "ddp", "fsdp")):
                folder = Path(f"{sys.argv[1]}-ckpt-{save_pp}-{load_pp}-{inside}-{load_inside}")
                out.write(json.dumps(checkpoint_case(ctx, folder, save_pp, load_pp, inside, load_inside)) + "\n")
            out.write(json.dumps(curve_case(ctx)) + "\n")
    dist.barrier()
    exit_without_finalizing(0)


def fork_ranks(world: int) -> int:
    """`world` ranks forked from this process, which has imported torch and the trainer once for all of them: 8
    processes of torchrun each importing them took 20 s of this 2-core machine before any work (what torchrun
    itself does is tested elsewhere). A rank that fails ends the others (a gloo peer would wait out its timeout);
    the exit code is the first failure's, or 0."""
    children = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            try:
                main()  # ends the process itself, with 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(1)
        children.append(pid)
    while children:
        pid, status = os.wait()
        children.remove(pid)
        if os.waitstatus_to_exitcode(status):
            for other in children:
                os.kill(other, signal.SIGKILL)
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:  # OUT WORLD: fork the ranks (MASTER_ADDR and MASTER_PORT from the environment)
        sys.exit(fork_ranks(int(sys.argv[2])))
    main()
