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

Each read and write-back is a one-group :class:`~offload.swap.session.SwapSession` on the
cache buffer: the same route, checks, checksums and typed views as a step's.
"""
from __future__ import annotations

import errno
import functools
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from offload.swap.pipeline import SwapPipeline
from offload.swap.session import SwapSession

__all__ = ["GroupCache", "serialized"]


# Every cache, for the fork hook below.
_CACHES: "weakref.WeakSet[GroupCache]" = weakref.WeakSet()


class GroupCache:
    """Random access to the committed states of ``pipeline.store``, one sub-group at a time."""

    def __init__(self, pipeline: SwapPipeline) -> None:
        self.pipeline = pipeline
        self.store = pipeline.store
        self.group: Optional[int] = None
        self.dirty = False
        self.pending: Optional[Dict[int, Any]] = None  # in a batch: g -> checksums, written, not committed
        self.lock = threading.RLock()  # see serialized()
        _CACHES.add(self)

    @property
    def _buf(self) -> Any:
        return self.pipeline.buffers[0]

    def _session(self, g: int, reads: Any = None, check: Any = None, fill: bool = True) -> SwapSession:
        """A one-group session on the cache buffer: reads from ``g``'s committed slot (or
        ``reads``; zeros when never written), writes into its free slot, checksums with
        ``verify``."""
        st = self.store
        return SwapSession(st.engine, [self._buf], [g], reads=reads or st.read_requests, writes=st.write_requests,
                           fill=self.pipeline.zero if fill else None, check=check or (st.check if st.verify else None),
                           checksum=st.checksum if st.verify else None)

    def load(self, g: int, extra: Optional[Callable[[], Dict[str, Any]]] = None) -> List[torch.Tensor]:
        """The state tensors of sub-group ``g`` (views into the cache buffer). A different
        dirty sub-group is flushed first, committing ``extra()`` with it."""
        _refuse_in_forked_child(self.store)
        if self.group == g:
            return self.pipeline.tensors(g, self._buf)
        self.flush(extra)
        self.group = None
        if self.pending is not None and g in self.pending:
            self._read_pending(g)
        else:
            self._session(g).acquire(g)  # the committed states, checked; zeros if never written
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
        g = self.group
        session = self._session(g, reads=lambda g, buf: [], fill=False)  # the buffer already holds g's new states
        session.acquire(g)
        session.finish(g)
        session.drain()
        sums = session.written[g]
        self.dirty = False
        if self.pending is not None:
            self.pending[g] = sums
            return True
        self.store.commit({g: sums}, extra() if extra is not None else None, advance=False)
        return True

    def _read_pending(self, g: int) -> None:
        """Read back what this batch already wrote for ``g`` (in its free slot)."""
        st = self.store
        free = st.files[1 - st.slots[g]]
        want = self.pending[g]

        def check(g: int, buf: Any) -> None:
            if want is not None and st.checksum(g, buf) != want:
                raise OSError(errno.EIO, f"sub-group {g} read back differs from what was just written to its "
                              "free slot", free.path)

        self._session(g, reads=st.read_back_requests, check=check).acquire(g)

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


def serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an owner of ``_cache`` (a GroupCache) run under the cache's lock. A step
    streams through the cache's buffer, which a read of ``opt.state[p]`` (or ``state_dict()``)
    in another thread loaded a sub-group into: the step then computed on and committed that
    sub-group's states in place of its own (a monitoring thread reading the moments changed the
    training; torch's reads never do). One at a time; the owner's own calls nest (RLock)."""
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._cache.lock:
            return method(self, *args, **kwargs)
    return locked



def _refuse_in_forked_child(store: Any) -> None:
    """The cache buffer is the pipeline's, registered with io_uring and so not mapped in a
    forked child (MADV_DONTFORK): a child reading ``opt.state[p]`` of a sub-group the parent
    had cached died of SIGSEGV. It gets the engine's error instead (the optimizer is the
    parent's)."""
    owner = getattr(store, "owner_pid", None)
    if owner is not None and owner != os.getpid():
        raise RuntimeError(f"swap cache: opened by process {owner}, used in process {os.getpid()}, a child forked "
                           "from it, which has none of its buffers, completion threads or ring; an offloaded "
                           "optimizer belongs to the process that made it: make a new one in the child, or fork "
                           "before making it")


def _new_locks_in_child() -> None:
    """A child forked while another thread of the parent held a cache's lock (its step, a
    read) would wait on it forever at its first read of ``opt.state[p]``: its own locks."""
    for cache in list(_CACHES):
        cache.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_in_child)
