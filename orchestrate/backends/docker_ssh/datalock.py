"""A data folder's lock, held while `up` fills the folder (a fetch, a sent archive, `--data-from` staging).

Two `up`s (of one login or of two) into one folder at the same moment make one copy: the second waits, bounded,
with a line saying so, then finds the first one's verified copy and moves nothing. The lock is flock(1) on
`.ddp-cifar.lock` in the folder, held by a shell on the node (remote/scripts/data_lock.sh) for as long as its SSH
channel stays open, so an `up` that is killed never leaves it held. A folder the login may not write (another
person's) is only ever read: a verified copy there is used as it is, else one line names its owner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import paramiko

from orchestrate.errors import SSHError
from orchestrate.remote import scripts
from orchestrate.remote.ssh import Connection, quote_command

SCRIPT = scripts.text("data_lock.sh")
LOCK_WAIT_S = 3600  # as long as a fetch may take (data.py waits as long for its container)


class DataFolderError(SSHError):
    """The data folder cannot be filled here: it is another login's, or its lock stayed held. Raised inside a
    fan-out, which puts the host before the message."""


@dataclass(frozen=True)
class Held:
    writable: bool  # the folder is the login's to fill; else only a verified copy already there is usable
    owner: str  # "name (uid N)" of the folder, when it is not writable
    waited_s: float  # time spent waiting for another holder

    def refuse(self, folder: str, lacking: str) -> DataFolderError:
        return DataFolderError(f"data folder {folder} belongs to {self.owner} and {lacking}, and this login "
                               "may not write there; ask them to run `up` once, or set data_dir= to a folder of yours")


@contextmanager
def data_lock(conn: Connection, folder: str, say: Callable[[str], None],
              wait_s: int = LOCK_WAIT_S) -> Iterator[Held]:
    """Hold `folder`'s lock for the body of the `with`; `say` gets the line when another holder makes us wait."""
    chan = conn.open_channel()
    try:
        chan.settimeout(wait_s + 60)
        chan.exec_command(quote_command(["sh", "-c", SCRIPT, "data-lock", folder, str(wait_s)]))
        yield _until_locked(chan, conn.host.label, folder, say, wait_s)
    finally:
        chan.close()  # the shell's standard input ends: the lock is released


def _until_locked(chan: paramiko.Channel, label: str, folder: str, say: Callable[[str], None],
                  wait_s: int) -> Held:
    start = time.monotonic()
    busy = False
    for line in _lines(chan):
        if line == "BUSY":
            busy = True
            say(f"data on {label}: another up is filling {folder}; waiting for it (at most {wait_s // 60} min)")
        elif line.startswith("LOCKED "):
            how, _, owner = line.removeprefix("LOCKED ").partition(" ")
            waited = time.monotonic() - start if busy else 0.0
            if busy:
                say(f"data on {label}: the other up's copy in {folder} is done after {waited:.1f} s")
            return Held(how == "WRITE", owner, waited)
    if busy:
        raise DataFolderError(f"data folder {folder} stayed locked by another up for {wait_s // 60} min; "
                              "see `status --all` on that host, or set data_dir= to another folder")
    err = chan.recv_stderr(4096).decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise SSHError(f"cannot lock data folder {folder}: {err[0]}")


def _lines(chan: paramiko.Channel) -> Iterator[str]:
    """The channel's output, line by line, until it ends (bounded by the channel's timeout)."""
    pending = b""
    while True:
        try:
            block = chan.recv(4096)
        except TimeoutError:
            raise SSHError("the data folder's lock did not answer (host unreachable?)") from None
        if not block:
            return
        pending += block
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.decode(errors="replace")
