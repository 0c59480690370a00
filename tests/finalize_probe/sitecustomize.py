"""Put on PYTHONPATH with PROBE_DIR set: every rank (a process with RANK) that goes through the interpreter's
finalization leaves PROBE_DIR/finalized-<RANK>. torchrun's agent has no RANK and is left alone."""

import atexit
import os

if "RANK" in os.environ and "PROBE_DIR" in os.environ:
    _mark = os.path.join(os.environ["PROBE_DIR"], "finalized-" + os.environ["RANK"])
    atexit.register(lambda: open(_mark, "w").close())
