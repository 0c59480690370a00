"""Backends turn a plan into the request a scheduler is given, carry it out, and report on it: the Backend protocol
(protocol.py). Each is one folder here and one line in BACKENDS (choice.py). A scheduler that grants the hosts and
queues the jobs while a backend runs the containers (Scheduler in protocol.py) is one folder here and one line in
SCHEDULERS (schedulers.py). Nothing above this folder names either: the composition root (api.py) chooses the backend
and passes it down; the command line and `jobs/` ask SCHEDULERS. This file imports nothing, so that importing the
protocol loads no backend (and so neither paramiko nor docker-py)."""
