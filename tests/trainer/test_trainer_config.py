"""Config validation and the one-line command-line errors (unit, no torch work)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainer.__main__ import main
from trainer.config import Config, build_parser, parse
from trainer.errors import ConfigError

BASE = ["--data-dir", "/d", "--ckpt-dir", "/c"]


def test_defaults_parse_and_round_trip_to_plain_dict() -> None:
    cfg, legacy = parse(BASE)
    assert legacy is None
    assert cfg.model == "resnet18" and cfg.precision == "auto" and cfg.data_dir == Path("/d")
    assert cfg.to_dict()["ckpt_dir"] == "/c"  # plain str: loads with torch.load(weights_only=True)


def test_every_parser_default_is_the_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults are written once, on Config: a field's default changed there is the option's default."""
    fields = {f.name: f for f in dataclasses.fields(Config) if f.default is not dataclasses.MISSING}
    for field in fields.values():
        monkeypatch.setattr(field, "default", object())
    actions = {a.dest: a for a in build_parser()._actions if a.dest in fields}
    assert sorted(actions) == sorted(fields)
    assert [name for name, a in actions.items() if a.default is not fields[name].default] == []


@pytest.mark.parametrize("flag", ["--local_rank=3", "--local-rank=3"])
def test_legacy_local_rank_is_accepted(flag: str) -> None:
    assert parse([*BASE, flag])[1] == 3


@pytest.mark.parametrize(("args", "needle"), [
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--epochs", "-1"], "--epochs must be a positive integer"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--dist-timeout", "0"], "--dist-timeout"),
    (["--max-steps", "-5"], "--max-steps"),
    # nan passes every `< 0` check and inf overflows timedelta or the LR schedule: each is refused by name.
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number"),
    (["--momentum", "nan"], "--momentum must be a finite number"),
    (["--dist-timeout", "inf"], "--dist-timeout must be a finite number"),
    (["--dist-timeout", "1e9"], r"--dist-timeout must be > 0 and at most"),
    (["--seed", str(2**64)], r"--seed must be between 0 and 2\*\*63-1"),
    # the GPU defaults' settings (trainer/defaults.py)
    (["--lr-ref-batch", "-1"], "--lr-ref-batch must be the global batch"),
    (["--lr-ref-batch", "big"], "expected a global batch size, 'none' or 'auto'"),
    (["--eval-every-minutes", "nan"], "--eval-every-minutes must be a finite number"),
    (["--eval-every-minutes", "-1"], "--eval-every-minutes must be between 0"),
    (["--ckpt-async", "maybe"], "invalid choice"),
    # --pp (tests/trainer/test_trainer_pipeline.py runs what passes)
    (["--pp", "0"], "--pp must be a positive integer"),
    (["--pp", "2", "--model", "resnet18"], "--pp cannot split --model resnet18: it has BatchNorm, and each "
                                           "micro-batch would be normalised with its own statistics"),
    (["--pp", "2", "--model", "tiny"], "--pp cannot split --model tiny"),
    (["--pp", "2", "--model", "resnet20-gn", "--sync-bn"], "--pp cannot honour --sync-bn"),
    (["--pp", "2", "--model", "resnet20-gn", "--optimizer", "apex-fused-sgd"], "--pp cannot honour --optimizer apex"),
    (["--pp", "2", "--model", "resnet20-gn", "--grad-compression", "fp16"], "--pp cannot honour --grad-compression"),
    (["--pp", "2", "--model", "resnet20-gn", "--precision", "fp16"], "--pp cannot honour --precision fp16"),
    (["--pp", "2", "--model", "resnet20-gn", "--compile", "aot_eager"], "--pp cannot honour --compile"),
    (["--pp", "2", "--model", "resnet20-gn", "--pp-microbatches", "1"],
     "--pp-schedule 1f1b needs at least as many micro-batches as stages"),
    (["--pp", "2", "--model", "resnet20-gn", "--batch-size", "3"], "the global batch must divide by dp x micro"),
    (["--pp", "10", "--model", "resnet20-gn", "--batch-size", "40"], "--pp 10 exceeds the 9 blocks of resnet20-gn"),
    (["--pp", "5", "--model", "resnet20-gn", "--pp-schedule", "interleaved", "--batch-size", "20"],
     "10 stages need at least 10 blocks"),
    (["--pp", "4", "--model", "resnet18-gn", "--pp-schedule", "interleaved", "--pp-microbatches", "9",
      "--batch-size", "9"], "--pp-schedule interleaved needs --pp-microbatches a multiple of its rounds"),
    (["--pp", "2", "--model", "resnet20-gn", "--pp-split", "4,4"], "--pp-split 4,4: give 2 positive block counts"),
    (["--pp", "2", "--model", "resnet20-gn", "--pp-split", "best"], "--pp-split must be auto, uniform or block"),
    (["--pp", "2", "--model", "resnet20-gn", "--pp-schedule", "zb"], "invalid choice"),
])
def test_bad_values_raise_config_error_saying_how_to_fix(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse([*BASE, *args])


def test_config_is_frozen() -> None:
    cfg, _ = parse(BASE)
    with pytest.raises(AttributeError):
        cfg.epochs = 3  # type: ignore[misc]


@pytest.mark.parametrize("args", [["--no-such-option"], ["--precision", "fp8"], [], ["--epochs", "x", *BASE]])
def test_bad_command_line_is_one_error_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args if args and args[0] == "--epochs" else [*BASE, *args] if args else []) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_an_abbreviated_option_is_refused_not_guessed() -> None:
    """`--data` must not pass as --data-dir (the orchestrator reserves it), nor `--epoch` as --epochs."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --epoch"):
        parse([*BASE, "--epoch", "3"])


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match="--grad-compression"):
        Config(data_dir=Path("/d"), ckpt_dir=Path("/c"), grad_compression="int8")


def test_the_options_table_in_docs_lists_exactly_the_parsers_options() -> None:
    """docs/trainer.md's table is prose beside the parser: this keeps it from drifting (it had, twice)."""
    import re

    from trainer.config import build_parser

    options = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    rows = [ln for ln in doc.split("## Options", 1)[1].split("\n## ", 1)[0].splitlines() if ln.startswith("| `")]
    documented = {o for row in rows for o in re.findall(r"`(--[a-z0-9_-]+)", row.split("|")[1])}
    assert documented == options
