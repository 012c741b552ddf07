"""Paged tensors: host tensors whose pages may be on disk, and the calls that bring them in.

[Note: paged tensors] With ``offload.shard(..., offload_params="nvme")`` a rank's param
shards and their grads live in swap files; in memory each is a tensor over its own
anonymous mapping whose pages are *evicted* (``MADV_DONTNEED``: the RAM goes back to the
system and the pages read as zeros) except while someone works on them. Whoever reads or
writes the bytes of such a tensor says so first, on the exact 1-D contiguous views it
touches:

- ``load(views)`` before reading (the bytes are read from disk where not in memory);
- ``will_write(views)`` before overwriting every element of the views (only the pages
  the views share with their neighbours are read);
- ``store(views)`` after writing (to disk), ``evict(views)`` when done (RAM returned);
- ``check(views)`` before a job that will touch them (an optimizer's step): a write that
  bypassed these calls raises now, before the job changed anything (offload/shard/tier_writes.py).

The owner of such tensors (``offload/shard/tier.py``) registers their address ranges here
with a *pager* that does the work; a view of any other tensor is ignored, so the calls cost
one lookup where nothing is paged. This module is the seam through which the lower layers
(the stores' step loops, the flat groups' initial master) serve paged params without
knowing where they live. A paged tensor read without ``load`` shows zeros where evicted.
The host stores never step a paged fp32 param in place: its file is not crash-safe, so the
optimizer takes the flat store, whose master is the truth (``RuleOptimizer._make_store``).
"""
from __future__ import annotations

import bisect
from typing import Any, Dict, List, Sequence, Tuple

import torch

from offload.memory.reentry import FinalizerSafeLock

__all__ = ["register", "unregister", "paged", "load", "will_write", "store", "evict", "prefetch", "check", "active"]

_lock = FinalizerSafeLock()  # unregister runs in the tier's finalizer: [Note: finalizers re-enter]
_starts: List[int] = []
_areas: List[Tuple[int, int, Any]] = []  # (start, end, pager), sorted by start


def register(start: int, nbytes: int, pager: Any) -> None:
    """Bytes [start, start + nbytes) of this process are paged by ``pager``."""
    with _lock.held():
        i = bisect.bisect(_starts, start)
        _starts.insert(i, start)
        _areas.insert(i, (start, start + nbytes, pager))


def unregister(start: int) -> None:
    if _lock.defer(_unregister, start):
        return
    with _lock.held():
        _unregister(start)


def _unregister(start: int) -> None:
    i = bisect.bisect_left(_starts, start)
    if i < len(_starts) and _starts[i] == start:
        del _starts[i]
        del _areas[i]


def active() -> bool:
    return bool(_starts)


def paged(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are in a paged area."""
    return _find(t.data_ptr()) is not None


def _find(addr: int):
    i = bisect.bisect(_starts, addr) - 1
    if i >= 0:
        start, end, pager = _areas[i]
        if addr < end:
            return pager
    return None


def _by_pager(views: Sequence[Any]) -> Dict[int, Tuple[Any, List[Tuple[int, int]]]]:
    out: Dict[int, Tuple[Any, List[Tuple[int, int]]]] = {}
    if not _starts:
        return out
    for v in views:
        if v is None or not isinstance(v, torch.Tensor) or v.numel() == 0 or v.device.type != "cpu":
            continue
        addr = v.data_ptr()
        pager = _find(addr)
        if pager is None:
            continue
        if not v.is_contiguous():
            raise ValueError("a paged tensor is touched through a non-contiguous view; pass contiguous pieces")
        out.setdefault(id(pager), (pager, []))[1].append((addr, v.numel() * v.element_size()))
    return out


def _call(method: str, views: Sequence[Any]) -> None:
    for pager, ranges in _by_pager(views).values():
        getattr(pager, method)(ranges)


def load(views: Sequence[Any]) -> None:
    """Before reading ``views``: their bytes in memory (read from disk where evicted)."""
    _call("load", views)


def will_write(views: Sequence[Any]) -> None:
    """Before overwriting every element of ``views``."""
    _call("will_write", views)


def store(views: Sequence[Any]) -> None:
    """After writing ``views``: their bytes to disk."""
    _call("store", views)


def evict(views: Sequence[Any]) -> None:
    """Done with ``views``: the pages they cover whole leave RAM (they are on disk)."""
    _call("evict", views)


def prefetch(views: Sequence[Any]) -> None:
    """A hint: start reading ``views`` from disk now; a later ``load`` waits for it."""
    _call("prefetch", views)


def check(views: Sequence[Any]) -> None:
    """Before a job on ``views``: a write into them that bypassed these calls raises now."""
    _call("check", views)
