"""Run with the container's Python inside the job's container (orchestrate/watch/health.py): SIGUSR1 to every
process torchrun started (they have RANK in their environment; torchrun itself has not), and their global ranks
printed as JSON. Standard library only."""
import json
import os
import signal

found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ") as fh:
            env = dict(kv.split("=", 1) for kv in fh.read().split("\0") if "=" in kv)
    except OSError:
        continue
    if "RANK" in env and "LOCAL_RANK" in env and int(pid) != os.getpid():
        try:
            os.kill(int(pid), signal.SIGUSR1)
            found[env["RANK"]] = int(pid)
        except OSError:
            pass
print(json.dumps(found))
