"""Versions of the states a store keeps, so that a read copy knows whether it is stale.

[Note: state versions] A copy read from the store (read_copy.py) may write an in-place change
back ([Note: an in-place change of a read copy is written back] in write_back.py) only while
the store still holds what it read. Two integers tell: the store's ``_state_version``, bumped
once before and once after every step (a failed, restored step included), by every load
(``held_load``: load_state_dict, load_checkpoint), by ``clear_failure`` and by ``close``; and
one per (param, state) bumped by every assignment through an entry (``opt.state[p][k] = t``,
a write-back). A step count alone would not do: a load at the same step count changes the
states and not the count. Kept on the store (not in the entry, which a user may replace with
``opt.state[p] = {...}``), and bumped at those entry points, never per param in the step loop.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

__all__ = ["bump", "bump_key", "version_of"]


def bump(store: Any) -> None:
    """Every state ``store`` holds may have changed (a step, a load, a restore, a close)."""
    if store is not None:
        store._state_version = getattr(store, "_state_version", 0) + 1


def bump_key(store: Any, p: torch.Tensor, key: str) -> None:
    """``p``'s state ``key`` was assigned."""
    versions = store.__dict__.setdefault("_key_versions", {})
    versions[(id(p), key)] = versions.get((id(p), key), 0) + 1


def version_of(store: Any, p: torch.Tensor, key: str) -> Tuple[int, int]:
    """What a copy of ``p``'s ``key`` read now records; equal later only if neither changed."""
    return getattr(store, "_state_version", 0), getattr(store, "_key_versions", {}).get((id(p), key), 0)
