"""Run in a short container of the job's image (by find_python.sh): what it holds, as one JSON line.

argv: KIND ("module" or "script") and TARGET (the entry module or script path). Standard library only: the image's
own Python runs it, whatever its version.
"""
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys

kind, target = sys.argv[1], sys.argv[2]
out = {"python": sys.executable, "torch": None, "torchrun": shutil.which("torchrun"), "entry": False, "one_process": False}
try:
    out["torch"] = importlib.metadata.version("torch")
except importlib.metadata.PackageNotFoundError:
    pass
try:  # the project's launcher of one process a node (trainer/launch.py); its package may be another `trainer`
    out["one_process"] = importlib.util.find_spec("trainer.launch") is not None
except Exception:
    pass
try:
    out["entry"] = importlib.util.find_spec(target) is not None if kind == "module" else os.path.isfile(target)
except Exception as err:  # a package whose __init__ fails to import: the entry cannot start either
    out["entry_error"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
