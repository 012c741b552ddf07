"""One sub-group of a swap store held in a host buffer for random access.

The pipeline streams whole steps; everything else (``state_dict`` export and import, a
checkpoint's masters, restoring params after a failed step) touches a few elements here and
there. ``GroupCache`` serves those: it reads the committed states of one sub-group into a
buffer (the pipeline's first, which is idle between steps), hands out tensor views, and
when they were changed writes them into the sub-group's free slot and commits, flipping only
that sub-group (the step count does not advance). A kill in the middle leaves the previous
states in place, as for a step.

Between ``begin_batch()`` and ``commit_batch()`` the changed sub-groups are written into their
free slots but not committed; ``commit_batch`` flips them all in one manifest write (a whole
``load_state_dict``: a kill at any point leaves either every old state or every new one), and
``abort_batch`` forgets them (the manifest never named those slots).
"""
from __future__ import annotations

import errno
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
        self.pending: Optional[Dict[int, Any]] = None  # in a batch: g -> checksums, written, not committed

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
        if self.pending is not None and g in self.pending:
            self._read_pending(g)
            self.group = g
            return self.pipeline.tensors(g, self._buf)
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
        self.dirty = False
        if self.pending is not None:
            self.pending[g] = sums
            return True
        self.store.commit({g: sums}, extra() if extra is not None else None, advance=False)
        return True

    def _read_pending(self, g: int) -> None:
        """Read back what this batch already wrote for ``g`` (in its free slot)."""
        reqs = self.store._requests("read", 1 - self.store.slots[g], g, self._buf)
        eng = self.store.engine
        _check_counts(eng.wait(eng.submit(reqs)), reqs, "read")
        want = self.pending[g]
        if want is not None and self.store.checksum(g, self._buf) != want:
            raise OSError(errno.EIO, f"sub-group {g} read back differs from what was just written to its free slot",
                          self.store.files[1 - self.store.slots[g]].path)

    def begin_batch(self) -> None:
        """Collect the following changes for one ``commit_batch`` (see the module docstring)."""
        if self.dirty or self.pending is not None:
            raise RuntimeError("internal error: a batch begun with unflushed changes or inside another batch")
        self.group = None
        self.pending = {}

    def commit_batch(self, extra: Dict[str, Any]) -> None:
        """Write the last changed sub-group, then commit every sub-group of the batch and
        ``extra`` at once (also when nothing changed: ``extra`` holds the new steps)."""
        self.flush()
        pending, self.pending = self.pending or {}, None
        self.group = None
        self.store.commit(pending, extra, advance=False)

    def abort_batch(self) -> None:
        """Forget the batch: the manifest still names the slots of the states before it."""
        self.pending, self.group, self.dirty = None, None, False

    def invalidate(self) -> None:
        """Forget the cached sub-group (the pipeline is about to reuse the buffer). Flush first."""
        if self.dirty:
            raise RuntimeError("internal error: dropping a changed sub-group that was not flushed")
        self.group = None
