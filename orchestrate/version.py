"""The orchestrator's version: the containers' version label (plan/jobplan.py) and `orchestrate.__version__`."""

__version__ = "0.1.0"
