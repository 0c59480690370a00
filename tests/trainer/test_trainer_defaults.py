"""trainer/defaults.py: what "auto" becomes on a GPU and on the CPU, and that an option the user gives wins
(unit: a pure function of the Config, the device type and the global batch; no GPU needed)."""

from __future__ import annotations

import pytest

from trainer import defaults
from trainer.config import parse

BASE = ["--data-dir", "/d", "--ckpt-dir", "/c"]
H100, V100 = ("cuda", True), ("cuda", False)  # (device type, bf16 tensor cores)


def _resolve(*args: str, device: tuple[str, bool] = ("cpu", False), global_batch: int = 128) -> defaults.RunSettings:
    cfg, _ = parse([*BASE, *args])
    return defaults.resolve(cfg, device[0], device[1], global_batch)


def test_a_gpu_job_gets_bf16_time_based_async_checkpoints_and_evaluations() -> None:
    run = _resolve(device=H100, global_batch=4096)
    assert (run.precision, run.ckpt_every, run.ckpt_every_s, run.ckpt_async) == ("bf16", 0, 300.0, True)
    assert (run.eval_every, run.eval_every_s) == (0, 60.0)
    assert run.describe().startswith("settings: precision bf16 (auto: a GPU with bf16 tensor cores); lr 0.4 "
                                     "(0.1 x sqrt of global batch 4096 / 256, square root rule, ref auto), "
                                     "warmup 5 epochs")


def test_a_cpu_job_keeps_the_old_defaults() -> None:
    """fp32, --lr as given, a synchronous checkpoint and an evaluation after every epoch: the CPU tests' and
    the demo's runs mean what they meant."""
    run = _resolve(global_batch=4096)
    assert (run.precision, run.lr, run.warmup_epochs) == ("fp32", 0.1, 1.0)
    assert (run.ckpt_every, run.ckpt_every_s, run.ckpt_async, run.eval_every, run.eval_every_s) == (1, 0, False, 1, 0)


def test_a_gpu_without_bf16_tensor_cores_gets_fp32() -> None:
    run = _resolve(device=V100)
    assert run.precision == "fp32" and "--precision fp16 is faster" in run.describe()


@pytest.mark.parametrize("device", [H100, ("cpu", False)])
def test_every_option_the_user_gives_wins(device: tuple[str, bool]) -> None:
    run = _resolve("--precision", "fp16", "--lr", "0.2", "--lr-ref-batch", "512", "--warmup-epochs", "0.5",
                   "--ckpt-every", "2", "--ckpt-every-minutes", "0", "--ckpt-async", "off", "--eval-every", "3",
                   "--eval-every-minutes", "7", device=device, global_batch=1024)
    assert (run.precision, run.lr, run.warmup_epochs) == ("fp16", pytest.approx(0.2 * 2 ** 0.5), 0.5)
    assert (run.ckpt_every, run.ckpt_every_s, run.ckpt_async) == (2, 0.0, False)
    assert (run.eval_every, run.eval_every_s) == (3, 420.0)
    assert "(given)" in run.describe() and "auto" not in run.describe()


def test_the_batch_rule_and_its_warmup() -> None:
    """lr x global / ref up to ref, lr x sqrt(global / ref) past it (16 x 256 on GPU: 0.4, not the linear rule's
    1.6, which bench/lr_scale.py shows driving the loss back above its start); warmup 5 epochs when the rule raises
    the lr (16 x 256: 60 steps of 12 an epoch), at most half the run, at least 1."""
    assert _resolve(device=H100, global_batch=256).lr == 0.1
    assert _resolve(device=H100, global_batch=256).warmup_epochs == 1.0  # not raised: the usual 1 epoch
    assert _resolve(device=H100, global_batch=128).lr == 0.05
    assert _resolve(device=H100, global_batch=1024).lr == pytest.approx(0.2)
    assert _resolve(device=H100, global_batch=4096).lr == pytest.approx(0.4)
    assert _resolve(device=H100, global_batch=4096).warmup_epochs == 5.0
    assert _resolve("--epochs", "4", device=H100, global_batch=1024).warmup_epochs == 2.0
    assert _resolve("--epochs", "1", device=H100, global_batch=1024).warmup_epochs == 1.0
    assert _resolve("--lr-ref-batch", "none", device=H100, global_batch=4096).lr == 0.1
    assert _resolve("--lr-ref-batch", "64", global_batch=128).lr == pytest.approx(0.1 * 2 ** 0.5)  # CPU, asked


def test_a_checkpoint_keeps_what_the_user_wrote_so_a_resume_resolves_again() -> None:
    cfg, _ = parse(BASE)
    assert {k: cfg.to_dict()[k] for k in ("precision", "lr_ref_batch", "ckpt_every", "eval_every_minutes")} == \
        {"precision": "auto", "lr_ref_batch": None, "ckpt_every": None, "eval_every_minutes": None}
