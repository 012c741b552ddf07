"""One optimizer step of a swap store as a session: stream its sub-groups, then commit the
step with the ranks' agreement (or leave the store at the previous step, and say why).

``StepSession`` is a :class:`~offload.swap.session.SwapSession` routed through the store
(read the committed slot, write the other, see [Note: two slots] in store.py) with the
store's typed views, plus the step's two ends: ``guard()`` around the compute half (any
failure drains the I/O, casts this rank's failed vote, and turns an ``OSError`` into a
``SwapStepError``) and ``commit()`` (make the writes durable, vote, flip the manifest, vote
again, undo on a peer's failure: [Note: ranks vote before commit] in agreement.py).

Within a step the reads of ``g`` come from its committed slot and the writes go to the other
one ([Note: no read races a write] in session.py), and the step returns only after every
write has completed and the files were ``fdatasync``-ed, so the next step's reads see the data.

[Note: durability] A write is complete when the engine says so: with O_DIRECT the data is in
the device (possibly in its volatile cache), buffered it is in the page cache. Either survives
a ``kill -9``; to also survive a power cut the step ends with ``fdatasync`` of the slot files
before the manifest flips (cheap with O_DIRECT: a cache flush, no data copy).
"""
from __future__ import annotations

import contextlib
import errno
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

from offload.swap import fsutil
from offload.swap.agreement import Agreement, Vote
from offload.swap.readonly import read_only_now
from offload.swap.session import SwapSession

__all__ = ["StepSession", "SwapStepError", "peers_failed"]

Extra = Union[None, Dict[str, Any], Callable[[], Dict[str, Any]]]


class SwapStepError(OSError):
    """An I/O failure aborted a step. The swap files and manifest are still at the previous
    step; ``computed`` lists the sub-groups whose compute callback already ran."""

    def __init__(self, err: int, msg: str, path: Optional[str], computed: List[int]) -> None:
        super().__init__(err, msg, path)
        self.computed = computed


def peers_failed(failed: List[int], step: Optional[int], path: Optional[str], computed: List[int],
                 held: str = "") -> SwapStepError:
    """The error of a rank whose own step was fine when the vote says ``failed`` ranks' were not."""
    what = f"swap step {step}" if step is not None else "the swap step"
    msg = f"{what} was applied on no rank: the swap step of rank {', '.join(map(str, failed))} failed"
    return SwapStepError(errno.ECANCELED, msg + (f"; {held}" if held else ""), path, computed)


class StepSession(SwapSession):
    """A step over ``groups`` (ascending) of ``pipeline.store`` through the pipeline's buffers."""

    def __init__(self, pipeline: Any, groups: Sequence[int], vote: Optional[Vote]) -> None:
        store = pipeline.store
        self.store, self.pipeline = store, pipeline
        self.agreement = Agreement(vote, f"the swap step of {store.path}")
        self.t_open = time.perf_counter()
        verify = store.verify
        super().__init__(store.engine, pipeline.buffers, groups, reads=store.read_requests,
                         writes=store.write_requests, fill=pipeline.zero,
                         check=store.check if verify else None, checksum=store.checksum if verify else None,
                         helpers=pipeline.verify_helpers() if verify else None)

    def views(self, g: int) -> List[torch.Tensor]:
        """Acquire ``g`` and hand out its state tensors (zero-copy views of its buffer)."""
        return self.pipeline.tensors(g, self.acquire(g))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """The compute half of the step: on any failure wait for the I/O in flight, vote
        that this rank failed, and raise (an OSError as a SwapStepError naming the point)."""
        try:
            yield
        except BaseException as exc:
            self.abort()
            self.agreement.fail()
            if isinstance(exc, OSError) and not isinstance(exc, SwapStepError):
                store = self.store
                msg = (f"swap step {store.step + 1} aborted at sub-group {len(self.computed)} of "
                       f"{len(self.groups)}: {exc.strerror or exc}; {store.held()}{read_only_now(store.path, exc.errno)}")
                raise SwapStepError(exc.errno or errno.EIO, msg, exc.filename or store.path, self.computed) from exc
            raise

    def commit(self, extra: Extra = None, *, commit: bool = True) -> Dict[str, float]:
        """After ``drain()``: with several ranks make the writes durable and agree; then
        (unless ``commit=False``) flip the manifest with ``extra`` (a dict, or a callable
        evaluated now) and agree again. Returns the step's timings."""
        tc = time.perf_counter()
        if self.agreement.several:
            self._prepare()
        if commit:
            self._commit(extra)
        now = time.perf_counter()
        return self.times.stats(now - tc, now - self.t_open, len(self.groups))

    def _error(self, exc: OSError, what: str) -> SwapStepError:
        store = self.store
        msg = f"swap step {store.step + 1} {what}: {exc.strerror or exc}; {store.held()}{read_only_now(store.path, exc.errno)}"
        return SwapStepError(exc.errno or errno.EIO, msg, exc.filename or store.path, self.computed)

    def _prepare(self) -> None:
        store = self.store
        try:
            with self.agreement.failing():
                store.sync()
        except OSError as exc:
            raise self._error(exc, "could not be made durable") from exc
        failed = self.agreement.prepared()
        if failed:
            raise peers_failed(failed, store.step + 1, store.path, self.computed,
                               f"the swap files still hold step {store.step}")

    def _commit(self, extra: Extra) -> None:
        store = self.store
        try:
            with self.agreement.failing():  # the second vote: the others undo theirs
                store.commit(self.written, extra() if callable(extra) else extra, synced=self.agreement.several)
        except OSError as exc:
            raise self._error(exc, "could not be committed") from exc
        if not self.agreement.several:
            return
        try:
            failed = self.agreement.committed()
        except Exception as exc:
            # The vote itself failed (a peer died: the collective's error): this rank cannot
            # know whether the others committed. A peer that died before its commit is the
            # likely case, and leaves the step before on its files: undo ours to match (a resume
            # goes back or refuses: [Note: a rank one step ahead] in agreement.py).
            raise self._undo(f"the ranks' vote on it failed ({type(exc).__name__}: a rank died?)") from exc
        if failed:
            raise self._undo(f"rank {self.agreement.ranks()} could not commit it")

    def _undo(self, why: str) -> SwapStepError:
        store = self.store
        step = store.step
        try:
            store.undo_commit()
            held = f"this rank's commit was undone: the swap files still hold step {store.step}"
        except fsutil.ReplacedNotDurable as exc:  # undone for every reader, maybe not for a power cut
            held = f"this rank's commit was undone ({exc.strerror}): the swap files still hold step {store.step}"
        except OSError as exc:
            held = (f"undoing this rank's commit failed too ({exc.strerror or exc}): its swap files "
                    f"hold step {step}, the other rank's the step before")
        msg = f"swap step {step} was applied on no rank: {why}; {held}"
        return SwapStepError(errno.ECANCELED, msg, store.path, self.computed)
