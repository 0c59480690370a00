"""Job files: `up -f job.toml` holds any option of `up` (its long name, `-` or `_`), and `args` for the program.

One schema: the keys, their types, choices and help are the `up` parser's own options (cli.py), and their defaults
the config's (config.py); a file's values go through the same conversions as the command line's, which then
overrides them. A job's merged options are stored with its local state, so `up --resume --job NAME` needs nothing
else.

    # job.toml
    hosts = "hosts.txt"          # relative to the job file's folder
    job = "r18"
    gpus = 8
    max_restarts = 3
    env = { NCCL_DEBUG = "WARN" }
    args = ["--epochs", "30", "--precision", "bf16"]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from orchestrate.errors import ConfigError
from trainer.errors import shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ARGS_KEY = "args"  # the program's arguments (what follows -- on the command line)
NOT_IN_FILES = {"help", "file", "trainer_args", "command"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILES}  # noqa: SLF001 - argparse's schema


def load(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's options as parser defaults ({dest: value}), each checked like its command-line form; a bad key
    or value raises ConfigError naming the file and line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"job file {shown(path)} cannot be read: {getattr(err, 'strerror', None) or err}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{shown(path)}: not valid TOML: {err}") from None
    actions = _actions(parser)
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{shown(path)}:{_line_of(text, key)}"
        dest = key.replace("-", "_")
        if dest == ARGS_KEY:
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigError(f"{where}: {key} must be a list of strings, e.g. args = [\"--epochs\", \"30\"]")
            out["trainer_args"] = list(value)
            continue
        action = actions.get(dest)
        if action is None:
            known = ", ".join(sorted(k for k in actions) + [ARGS_KEY])
            raise ConfigError(f"{where}: unknown key {key!r}; a job file takes up's options: {known}")
        out[dest] = _convert(action, key, value, where, path.parent)
    return out


def _convert(action: argparse.Action, key: str, value: Any, where: str, base: Path) -> Any:
    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} = {value!r}: write true or false")
        return value
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - env: a table or a list of NAME=VALUE
        items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else value
        if not (isinstance(items, list) and all(isinstance(v, (str, int, float)) for v in items)):
            raise ConfigError(f"{where}: {key} must be a table (NAME = \"value\") or a list of \"NAME=VALUE\"")
        return [str(v) for v in items]
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ConfigError(f"{where}: {key} = {value!r}: expected a single value")
    text = str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (ValueError, TypeError, ConfigError) as err:
        raise ConfigError(f"{where}: {key} = {value!r}: {err}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {key} = {value!r}: choose one of {', '.join(map(str, action.choices))}")
    if isinstance(converted, Path) and not converted.is_absolute() and not text.startswith("~"):
        converted = base / converted  # paths in a file are relative to the file
    return converted


def _line_of(text: str, key: str) -> int:
    found = re.search(rf'^[ \t]*"?{re.escape(key)}"?[ \t]*=', text, re.MULTILINE)
    return text.count("\n", 0, found.start()) + 1 if found else 1


def dump(options: dict[str, Any], defaults: dict[str, Any]) -> str:
    """PURE: the options that differ from the defaults, as a job file (what --dry-run prints)."""
    lines = []
    for key, value in sorted(options.items()):
        if key == "trainer_args" or value == defaults.get(key) or value is None:
            continue
        lines.append(f"{key} = {_toml(value)}")
    if options.get("trainer_args"):
        lines.append(f"{ARGS_KEY} = {_toml(list(options['trainer_args']))}")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def from_state(stored: Any, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The options a job's last `up` stored (state.py) as parser defaults: hosts, ssh config, every option that
    the parser knows, the program's arguments. `--env` values are not stored (they may be secrets)."""
    actions = _actions(parser)
    out: dict[str, Any] = {"hosts": Path(stored.hosts_file)}
    if stored.ssh_config:
        out["ssh_config"] = Path(stored.ssh_config)
    for key, value in stored.options.items():
        if key == "trainer_args":
            out["trainer_args"] = list(value)
        elif key in actions and not isinstance(actions[key], argparse._AppendAction) and value is not None:  # noqa: SLF001
            out[key] = _stored_value(actions[key], value)
    if stored.options.get("gpu_ids"):  # --gpus as device indices: the stored count alone would mean GPUs 0..N-1
        out["gpus"] = tuple(stored.options["gpu_ids"])
    return out


def _stored_value(action: argparse.Action, value: Any) -> Any:
    """A stored (already converted) value back into what the parser's type gives."""
    if action.type is Path or (callable(action.type) and getattr(action.type, "__name__", "") == "Path"):
        return Path(value)
    return value


def of_config(config: Any) -> str:
    """PURE: a job as a job file (secrets masked): the options that differ from the defaults. What `--dry-run`
    prints first, and what `up -f` of that text would apply."""
    from orchestrate.config import option_defaults
    from orchestrate.gpuspec import GPUS_ALL
    from orchestrate.masking import mask_text, masked_env, secret_values, url_masked
    from orchestrate.plan.gpus import gpus_text

    skip = {"dry_run", "dry_run_hosts", "as_json", "env", "gpu_ids", "gpus_on_cpu"}  # gpus_on_cpu: the hosts' setting
    defaults = {k: v for k, v in option_defaults().items() if k not in skip}
    options: dict[str, Any] = {k: v for k, v in config.options().items() if k in defaults}
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in options.items()}
    options["data_url"] = url_masked(options["data_url"])
    if config.resources.gpus == GPUS_ALL:
        options["gpus"] = defaults["gpus"] = "all"
    if config.resources.gpu_ids:  # device indices, as --gpus takes them back
        options["gpus"] = gpus_text(config.resources.gpu_ids)
    head = {"hosts": str(config.ssh.hosts_file)} if config.ssh.hosts_file else {}
    if config.ssh.ssh_config:
        head["ssh_config"] = str(config.ssh.ssh_config)
    env = [f"{k}={v}" for k, v in masked_env(config.program.env_dict).items()]
    body = dump({**head, **options, **({"env": env} if env else {})}, defaults)
    return mask_text(body, secret_values(config.program.env_dict))  # a secret's value also hides in the program's args
