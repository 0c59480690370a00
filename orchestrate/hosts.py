"""Hosts file and ~/.ssh/config → a list of Host records (node 0 first).

Hosts file syntax, one host a line: ``[user@]host[:port] [slots=N] [gpu_ids=0,1] [key=value ...]``; ``#`` starts a comment.
The DeepSpeed/MPI form ``host slots=N`` is accepted as is. Every error names the file and the line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.config import MAX_SLOTS
from orchestrate.errors import HostsFileError
from orchestrate.gpuspec import MAX_GPU_INDEX
from orchestrate.hostdirs import host_dir_problem
from trainer.errors import shown

if TYPE_CHECKING:  # imported where ssh configs are read: the pure plan imports Host without loading SSH
    import paramiko

# Host names and users are restricted to plain characters: nothing that a shell could interpret.
_NAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
_IFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_DOCKER_HOST_RE = re.compile(r"^(unix://|tcp://|ssh://)\S+$")
PATH_KEYS = ("data_dir", "ckpt_dir", "log_dir")

MAX_HOST_NAME = 253  # DNS (RFC 1035)
KNOWN_KEYS = ("slots", "gpu_ids", "docker_host", "iface", *PATH_KEYS)
_INDICES_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")


@dataclass(frozen=True)
class Host:
    """One node, as the hosts file names it and the ssh config resolves it."""

    name: str  # as written in the hosts file (without user/port); what messages show
    hostname: str  # to connect to (HostName from ssh config, or name)
    port: int
    user: str | None
    key_filenames: tuple[str, ...] = ()
    known_hosts_files: tuple[str, ...] = ()
    identities_only: bool = False  # ssh config IdentitiesOnly: use only key_filenames, no agent/default keys
    slots: int | None = None
    gpu_ids: tuple[int, ...] = ()  # gpu_ids=0,1: the device indices the job gets here (an allocator's grant)
    docker_host: str | None = None
    iface: str | None = None
    data_dir: str | None = None
    ckpt_dir: str | None = None
    log_dir: str | None = None
    source: str = ""  # "FILE:LINE" for messages

    @property
    def label(self) -> str:
        return self.name if self.port == 22 else f"{self.name}:{self.port}"


def default_ssh_config() -> Path:
    return Path(os.path.expanduser("~/.ssh/config"))


def parse_hosts_file(path: str | os.PathLike[str], ssh_config: str | os.PathLike[str] | None = None,
                     run_match_exec: bool = True) -> list[Host]:
    """Read a hosts file; resolve each host through the ssh config (default ~/.ssh/config if present).
    `run_match_exec=False` (a dry run, which runs nothing): the config's `Match exec` blocks are left out."""
    path = Path(path)
    try:
        data = path.read_bytes()
        text = data.decode()
    except UnicodeDecodeError as err:
        bad_line = data[:err.start].count(b"\n") + 1
        raise HostsFileError(f"{shown(path)}:{bad_line}: not UTF-8 text (byte {data[err.start]:#04x}); save the hosts file "
                             "as UTF-8") from None
    except FileNotFoundError:
        raise HostsFileError(f"hosts file {shown(path)} does not exist; write one host a line, e.g. 'gpu1 slots=8'") from None
    except OSError as err:
        raise HostsFileError(f"hosts file {shown(path)} cannot be read: {err.strerror}") from None
    config = load_ssh_config(ssh_config, run_match_exec)
    hosts: list[Host] = []
    seen: dict[tuple[str, int], str] = {}
    # Newlines only: str.splitlines() also splits at \f, \v, \x85, \u2028..., and the error would name the wrong line.
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{shown(path)}:{number}"
        host = parse_line(line, where, config)
        # Host names are case-insensitive (DNS, ssh): GPU-A and gpu-a are one machine.
        key = (host.hostname.lower(), host.port)
        if key in seen or (host.name.lower(), host.port) in seen:
            first = seen.get(key) or seen[(host.name.lower(), host.port)]
            raise HostsFileError(f"{where}: duplicate host {host.label!r} (already on {first}); list each host once")
        seen[key] = where
        seen[(host.name.lower(), host.port)] = where
        hosts.append(host)
    if not hosts:
        raise HostsFileError(f"hosts file {shown(path)} lists no hosts; write one host a line, e.g. 'gpu1 slots=8'")
    return hosts


def ssh_config_path(path: str | os.PathLike[str] | None) -> Path:
    return Path(path) if path is not None else default_ssh_config()


def match_exec_blocks(text: str) -> list[tuple[int, int]]:
    """PURE: (first, last) line numbers of each `Match ... exec ...` block of an ssh config: paramiko runs its
    command (through invoke) while looking a host up."""
    blocks: list[tuple[int, int]] = []
    start: int | None = None
    lines = text.split("\n")  # as paramiko reads the file: lines end at \n only
    for number, raw in enumerate(lines, start=1):
        words = raw.split("#", 1)[0].replace("=", " ").split()
        if words and words[0].lower() in ("host", "match"):
            if start is not None:
                blocks.append((start, number - 1))
            is_exec = words[0].lower() == "match" and any(w.lower() == "exec" for w in words[1:])
            start = number if is_exec else None
    if start is not None:
        blocks.append((start, len(lines)))
    return blocks


def load_ssh_config(path: str | os.PathLike[str] | None, run_match_exec: bool = True) -> paramiko.SSHConfig:
    import paramiko

    cfg_path = ssh_config_path(path)
    if not cfg_path.exists():
        if path is not None:
            raise HostsFileError(f"ssh config {shown(cfg_path)} does not exist; give an existing file with --ssh-config")
        return paramiko.SSHConfig()
    try:
        if run_match_exec:
            return paramiko.SSHConfig.from_path(str(cfg_path))
        lines = cfg_path.read_text().split("\n")
        for first, last in match_exec_blocks("\n".join(lines)):
            lines[first - 1:last] = [""] * (last - first + 1)
        return paramiko.SSHConfig.from_text("\n".join(lines))
    except Exception as err:  # paramiko raises plain exceptions for bad syntax
        raise HostsFileError(f"ssh config {shown(cfg_path)} cannot be parsed: {shown(err)}") from None


def parse_line(line: str, where: str, config: paramiko.SSHConfig) -> Host:
    """Parse one non-empty hosts-file line (comments already stripped)."""
    first, *pairs = line.split()
    user, name, port = _split_target(first, where)
    keys = _parse_pairs(pairs, where)
    looked = config.lookup(name)
    resolved_port = port if port is not None else _int(looked.get("port", "22"), "Port in ssh config", where)
    if not 1 <= resolved_port <= 65535:
        raise HostsFileError(f"{where}: port {resolved_port} (from the ssh config) out of range; use 1-65535")
    return Host(
        name=name,
        hostname=looked.get("hostname", name),
        port=resolved_port,
        user=user or looked.get("user"),
        key_filenames=tuple(os.path.expanduser(p) for p in looked.get("identityfile", [])),
        known_hosts_files=tuple(os.path.expanduser(p) for p in looked.get("userknownhostsfile", "").split()),
        identities_only=looked.get("identitiesonly", "no").lower() == "yes",
        slots=_slots(keys.get("slots"), where),
        gpu_ids=_gpu_ids(keys.get("gpu_ids"), where),
        docker_host=_checked(keys.get("docker_host"), _DOCKER_HOST_RE, "docker_host", where,
                             "e.g. docker_host=unix:///run/user/1000/docker.sock"),
        iface=_checked(keys.get("iface"), _IFACE_RE, "iface", where, "give a network interface name, e.g. iface=eth0"),
        data_dir=_abs_path(keys.get("data_dir"), "data_dir", where),
        ckpt_dir=_abs_path(keys.get("ckpt_dir"), "ckpt_dir", where),
        log_dir=_abs_path(keys.get("log_dir"), "log_dir", where),
        source=where,
    )


def _split_target(text: str, where: str) -> tuple[str | None, str, int | None]:
    user: str | None = None
    if "@" in text:
        user, text = text.split("@", 1)
        if not _USER_RE.fullmatch(user):
            raise HostsFileError(f"{where}: bad user name {user!r}; write [user@]host[:port]")
    port: int | None = None
    if text.count(":") == 1:
        text, port_text = text.split(":")
        port = _int(port_text, "port", where)
        if not 1 <= port <= 65535:
            raise HostsFileError(f"{where}: port {port} out of range; use 1-65535")
    if not _NAME_RE.fullmatch(text):
        raise HostsFileError(f"{where}: bad host name {text!r}; write [user@]host[:port] [slots=N] [key=value ...]")
    if len(text) > MAX_HOST_NAME:
        raise HostsFileError(f"{where}: host name of {len(text)} characters; a DNS name has at most {MAX_HOST_NAME}")
    return user, text, port


def _parse_pairs(pairs: list[str], where: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise HostsFileError(f"{where}: expected key=value, got {pair!r}")
        if key not in KNOWN_KEYS:
            raise HostsFileError(f"{where}: unknown key {key!r}; known keys: {', '.join(KNOWN_KEYS)}")
        if key in keys:
            raise HostsFileError(f"{where}: key {key!r} given twice")
        keys[key] = value
    return keys


def _int(text: str, what: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise HostsFileError(f"{where}: {what} must be a whole number, got {text!r}") from None


def indices(text: str) -> list[int]:
    """Device indices as written: `0-1,3` → [0, 1, 3]. ValueError for a range that is empty (`3-2`) or reaches
    above MAX_GPU_INDEX: expanding `0-99999999999999` would exhaust the memory before any check saw it."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"range {part} is empty; write it low-high")
        if high > MAX_GPU_INDEX:
            raise ValueError(f"index {high} is above {MAX_GPU_INDEX}")
        out.extend(range(low, high + 1))
    return out


def _gpu_ids(text: str | None, where: str) -> tuple[int, ...]:
    checked = _checked(text, _INDICES_RE, "gpu_ids", where, "give device indices, e.g. gpu_ids=0,1 or 4-7") or ""
    try:
        ids = indices(checked)
    except ValueError as err:
        raise HostsFileError(f"{where}: gpu_ids={text}: {err} (e.g. gpu_ids=4-7)") from None
    if len(set(ids)) != len(ids):
        raise HostsFileError(f"{where}: gpu_ids={text}: an index repeats; give each index once (e.g. gpu_ids=4-7)")
    return tuple(ids)


def _slots(text: str | None, where: str) -> int | None:
    if text is None:
        return None
    slots = _int(text, "slots", where)
    if not 1 <= slots <= MAX_SLOTS:
        raise HostsFileError(f"{where}: slots={slots} must be between 1 and {MAX_SLOTS} (the processes or GPUs to "
                             "use on the host)")
    return slots


def _checked(text: str | None, pattern: re.Pattern[str], key: str, where: str, hint: str) -> str | None:
    if text is not None and not pattern.fullmatch(text):
        raise HostsFileError(f"{where}: bad {key} value {text!r}; {hint}")
    return text


def _abs_path(text: str | None, key: str, where: str) -> str | None:
    if text is None:
        return None
    problem = host_dir_problem(text)
    if problem:
        raise HostsFileError(f"{where}: {key} {problem}; got {text!r}")
    return text if text.startswith("~") else os.path.normpath(text)
