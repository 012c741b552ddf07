"""One sub-group of a swap store held in a host buffer for random access.

The pipeline streams whole steps; everything else (``state_dict`` export and import, a
checkpoint's masters, restoring params after a failed step) touches a few elements here and
there. ``GroupCache`` serves those: it reads the committed states of one sub-group into a
buffer (the pipeline's first, which is idle between steps), hands out tensor views, and
when they were changed writes them into the sub-group's free slot and commits, flipping only
that sub-group (the step count does not advance). A kill in the middle leaves the previous
states in place, as for a step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from offload.swap.pipeline import SwapPipeline, _check_counts

__all__ = ["GroupCache"]


class GroupCache:
    """Random access to the committed states of ``pipeline.store``, one sub-group at a time."""

    def __init__(self, pipeline: SwapPipeline) -> None:
        self.pipeline = pipeline
        self.store = pipeline.store
        self.group: Optional[int] = None
        self.dirty = False

    @property
    def _buf(self) -> Any:
        return self.pipeline.buffers[0]

    def load(self, g: int, extra: Optional[Callable[[], Dict[str, Any]]] = None) -> List[torch.Tensor]:
        """The state tensors of sub-group ``g`` (views into the cache buffer). A different
        dirty sub-group is flushed first, committing ``extra()`` with it."""
        if self.group == g:
            return self.pipeline.tensors(g, self._buf)
        self.flush(extra)
        self.group = None
        reqs = self.store.read_requests(g, self._buf)
        if reqs:
            eng = self.store.engine
            _check_counts(eng.wait(eng.submit(reqs)), reqs, "read")
            self.store.check(g, self._buf)
        else:
            self.pipeline._zero(g, self._buf)  # never written: zeros
        self.group = g
        return self.pipeline.tensors(g, self._buf)

    def mark_dirty(self) -> None:
        if self.group is None:
            raise RuntimeError("GroupCache.mark_dirty() without a loaded sub-group")
        self.dirty = True

    def flush(self, extra: Optional[Callable[[], Dict[str, Any]]] = None) -> bool:
        """Write the changed sub-group into its free slot and commit; True when it did."""
        if not self.dirty or self.group is None:
            return False
        g, buf = self.group, self._buf
        sums = self.store.checksum(g, buf) if self.store.verify else None
        reqs = self.store.write_requests(g, buf)
        eng = self.store.engine
        _check_counts(eng.wait(eng.submit(reqs)), reqs, "write")
        self.store.commit({g: sums}, extra() if extra is not None else None, advance=False)
        self.dirty = False
        return True

    def invalidate(self) -> None:
        """Forget the cached sub-group (the pipeline is about to reuse the buffer). Flush first."""
        if self.dirty:
            raise RuntimeError("internal error: dropping a changed sub-group that was not flushed")
        self.group = None
