"""Writes past the param tier's pager: found, and refused by name (tier.py calls these).

[Note: writes past the pager] A paged shard is an ``nn.Parameter`` like any other, so a torch
optimizer over ``model.parameters()``, ``p.add_()`` or ``p.data.copy_()`` can write it without
``paging.will_write`` / ``store`` ([Note: paged tensors] in offload/memory/paging.py). Where its
pages were on disk such a write read zeros and lands in fresh pages that the next read of the
file overwrites (or the next drop discards); where they were in RAM and are dropped unstored it
is lost too. It used to vanish silently. The tier now finds it two ways, at every call on the
area (``load``, ``will_write``, ``prefetch``, ``evict``, and ``check``, which an optimizer's
step makes before it changes anything: step_guard.py ``check_work``) and before it drops
pages on disk:

- the tensor's version counter (shared by the shard ``nn.Parameter``, its views and
  ``detach()``; bumped by every in-place torch op, an optimizer's step included) moved since
  the tier's last ``store`` of the area or its creation: the tier's own writers (the
  optimizers' steps, checkpoint loads, ``load_state_dict``'s hooks, the grad reductions)
  ``store`` what they wrote before their next call on it;
- a page on disk holds a byte other than zero (``mincore`` says which such pages are in RAM at
  all: a dropped page reads as zeros until written): the writes that bump no counter,
  ``p.data.add_()``, ``torch.optim.AdamW(fused=True)``, numpy or ctypes.

A moved counter with every page of the area in RAM and valid (a unit computing with it, say)
is a write that read the true values: it is kept (stored as the pager's own). Anything else is
a ``RuntimeError`` that names the param, once: the write is lost, the area goes back to the
values on disk (its pages are dropped; a held area keeps its valid ones) and the next call
goes on from them. Not seen: zeros written through ``.data`` (or a fused step) into pages on
disk, which read as zeros already; a torch write into pages in RAM followed by one of the
tier's own stores of the same area before its next call.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from offload.memory import PAGE
from offload.memory.region import resident_pages

__all__ = ["written_on_disk", "lost_write_error"]


def written_on_disk(a: Any, q0: int, q1: int, on_disk: np.ndarray) -> bool:
    """Whether a page of ``[q0, q1)`` of area ``a`` where ``on_disk`` is true (dropped, so zeros
    until written) holds a byte other than zero. Reads only the pages mapped in RAM."""
    if q1 <= q0 or not on_disk.any():
        return False
    res = resident_pages(a.start + q0 * PAGE, (q1 - q0) * PAGE)
    if res is None:
        return False
    hit = (np.frombuffer(res, dtype=np.uint8) & 1).astype(bool) & on_disk
    if not hit.any():
        return False
    words = np.frombuffer(a.region.view(q0 * PAGE, (q1 - q0) * PAGE), dtype=np.uint64).reshape(q1 - q0, PAGE // 8)
    return bool(words[hit].any())


def lost_write_error(a: Any, path: str) -> RuntimeError:
    what = a.name or f"a paged tensor of {path}"
    return RuntimeError(
        f"offload.shard: {what} was written in place outside offload (a torch optimizer's step, p.add_(), "
        "p.data.copy_(), ...) while its pages were on disk (offload_params='nvme'): that write read zeros and "
        "cannot be kept, so it is dropped and the values on disk stay. Step a model with params on NVMe with "
        "offload.Adam / offload.AdamW over model.parameters(), and set values with model.load_state_dict() or "
        "offload.shard.load_weights()")
