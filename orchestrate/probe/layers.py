"""PURE: an image's layers as daemons know them: OCI chain IDs, and how many leading layers a node holds."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """OCI chain IDs: ChainID(L0) = DiffID(L0); ChainID(L0..n) = sha256(ChainID(L0..n-1) + " " + DiffID(Ln))."""
    chains: list[str] = []
    for diff in diff_ids:
        chains.append(diff if not chains else "sha256:" + hashlib.sha256(f"{chains[-1]} {diff}".encode()).hexdigest())
    return chains


def held_prefix(diff_ids: Sequence[str], held_chains: set[str]) -> int:
    """How many leading layers of the image the node holds (chain IDs nest: a held layer implies its parents)."""
    held = 0
    for chain in chain_ids(diff_ids):
        if chain not in held_chains:
            break
        held += 1
    return held


def all_chain_ids(layer_lists: Iterable[Sequence[str]]) -> set[str]:
    """Every chain ID that a daemon's images (given as their RootFS diff-ID lists) make it hold."""
    return {chain for layers in layer_lists for chain in chain_ids(layers)}
