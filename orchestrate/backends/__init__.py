"""The backends, in TorchX's words: a scheduler turns a plan into the request it runs, runs the job's containers on
the hosts and reports on them (the Scheduler protocol, protocol.py); each is one folder here and one line in SCHEDULERS
(choice.py). An allocator grants the hosts a scheduler runs on and queues the batch job that runs it (Allocator in
protocol.py); each is one folder here and one line in ALLOCATORS (allocators.py). Nothing above this folder names
either: the composition root (api.py) chooses the scheduler and passes it down; the command line and `jobs/` ask
ALLOCATORS. This file imports nothing, so that importing the protocol loads no backend (and so neither paramiko nor
docker-py)."""
