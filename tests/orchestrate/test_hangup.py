"""SIGHUP (the terminal of an attached `up` went away): the watch ends, nothing more is printed. Each case runs in
a process of its own, since the hangup points that process's stdout and stderr at /dev/null. The whole path, with
a real job on test hosts: tests/cluster/test_orchestrate_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BEFORE_THE_WATCH = """
import os, signal, sys
from orchestrate.watch.hangup import Hangup, TerminalGone
hangup = Hangup()
with hangup.handled():
    print("before", flush=True)
    os.kill(os.getpid(), signal.SIGHUP)  # while the image moves, say: `up` goes on to start the job
    print("after", flush=True)
    try:
        with hangup.watching():
            sys.exit(1)
    except TerminalGone:
        sys.exit(7 if hangup.happened else 1)
"""

DURING_THE_WATCH = """
import os, signal, sys, threading, time
from orchestrate.watch.hangup import Hangup, TerminalGone
hangup = Hangup()
with hangup.handled():
    print("before", flush=True)
    try:
        with hangup.watching():
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGHUP)).start()
            time.sleep(60)  # the watch waiting for the next poll: ended at once
    except TerminalGone:
        print("after", flush=True)
        sys.stderr.write("error: after\\n")
        sys.exit(7)
"""


@pytest.mark.parametrize("script", [BEFORE_THE_WATCH, DURING_THE_WATCH], ids=["before the watch", "during it"])
def test_a_hangup_ends_the_watch_and_silences_the_output(script: str, repo_root: Path) -> None:
    res = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert (res.returncode, res.stdout, res.stderr) == (7, "before\n", "")
