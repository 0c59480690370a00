"""Probe (I/O only): what each host has and what runs there, read before anything is planned or changed."""
