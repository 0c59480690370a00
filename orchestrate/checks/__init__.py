"""Checks before a job: the network check and the first-day self-test."""
