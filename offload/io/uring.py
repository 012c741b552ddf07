"""The ``uring`` engine: io_uring (python-liburing's ring, or our own where it cannot run:
[Note: native ring] in uring_native.py), completions reaped off the GIL.

[Note: waiting without the GIL] python-liburing holds the GIL inside ``io_uring_wait_cqe``
(another Python thread all but stops during the wait; bench/RESULTS.md). So the ring signals
an eventfd (``io_uring_register_eventfd``) and a reaper thread sleeps in ``select`` on it, which
releases the GIL; it then drains completions with ``io_uring_peek_cqe`` /
``io_uring_cq_advance``, resubmits short transfers, refills the queue up to ``queue_depth``
and completes tickets. Callers ``wait`` on a ``threading.Event``. A consequence: the queue is
refilled as completions arrive even while the submitting thread computes, which is what the
swap pipeline needs (submit now, wait later).

[Note: who submits] Only the reaper thread calls ``io_uring_submit``; ``submit`` queues the
pieces and pokes the eventfd. io_uring completes a request through task_work of the thread
that submitted it, which runs when that thread enters the kernel: a submitter that then
computes (a native Adam kernel, no syscalls for 100 ms) would hold back its own completions
until a timer tick (milliseconds of p99 latency instead of a fraction of one; bench/RESULTS.md,
Disk I/O). The reaper sleeps in ``select`` whenever it is idle, so completions are posted at
once; and the compute thread never pays the submission syscalls (inline O_DIRECT submission
pins pages and builds bios).

The ring-side pieces (the rewritable ``Iovec`` slots, the registered-buffer table, the
probe) are in ``uring_ring``: [Note: binding traps], [Note: fixed buffers].
"""
from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from .engine import Engine, _Piece, _address, as_bytes_view
from .uring_native import NativeRing, native_ring_reason
from .uring_ring import (  # noqa: F401  (_FIXED_SLOTS: tests read it here)
    _FIXED_MAX_BYTES,
    _FIXED_SLOTS,
    LiburingRing,
    _FixedTable,
    _ring_register,
    _set_dontfork,
)
from .uring_ring import uring_unavailable_reason as liburing_unavailable_reason

__all__ = ["UringEngine", "uring_unavailable_reason"]

log = logging.getLogger(__name__)

_RETRY = (errno.EINTR, errno.EAGAIN, errno.EBUSY)
RING_ENV = "OFFLOAD_URING_RING"
_RINGS = ("liburing", "native")


def _forced_ring() -> Optional[str]:
    """``$OFFLOAD_URING_RING`` (liburing or native), or None; ValueError for another value."""
    forced = os.environ.get(RING_ENV, "").strip().lower()
    if forced in ("", "auto"):
        return None
    if forced not in _RINGS:
        raise ValueError(f"{RING_ENV}={forced!r} is not a ring; expected liburing, native or auto")
    return forced


def ring_kind() -> Optional[str]:
    """The ring a ``uring`` engine opens here: python-liburing's where it runs, else ours
    ([Note: native ring]); None when neither can (``uring_unavailable_reason`` says why)."""
    forced = _forced_ring()
    if forced is not None:
        return forced if (liburing_unavailable_reason() if forced == "liburing" else native_ring_reason()) is None \
            else None
    if liburing_unavailable_reason() is None:
        return "liburing"
    return "native" if native_ring_reason() is None else None


def uring_unavailable_reason() -> Optional[str]:
    """None if an io_uring ring (either one) can be set up here, else why not (probed)."""
    try:
        if ring_kind() is not None:
            return None
        forced = _forced_ring()
    except ValueError as exc:
        return str(exc)
    if forced == "liburing":
        return liburing_unavailable_reason()
    if forced == "native":
        return f"the native ring: {native_ring_reason()}"
    return f"{liburing_unavailable_reason()}; the native ring: {native_ring_reason()}"


def _reaper_main(engine_ref, rio, efd: int) -> None:
    """The reaper thread: sleep in ``poll`` (GIL released), then let the engine reap.

    Holds the engine only between a wake-up and the end of its reaping. If the engine was
    collected without ``close()``, tear its ring down here (nobody else is left to); so too
    when ``close()`` was interrupted while this thread finished the I/O in flight.
    """
    # poll, not select: select cannot watch a descriptor numbered 1024 or more, which a
    # process with many files open gives the eventfd (the reaper died and every ticket hung)
    poller = select.poll()
    poller.register(efd, select.POLLIN)
    timeout = None
    poll_failed = False
    while True:
        try:
            poller.poll(timeout)
        except InterruptedError:
            continue
        except OSError as exc:
            # poll itself failed (ENOMEM, ...): the completions are still in the ring, so
            # reap them on a 1 ms clock until poll works again, rather than die and leave
            # every waiter hanging (failing them would free buffers the kernel still fills)
            if not poll_failed:
                log.warning("uring reaper: poll failed (%s); reaping every millisecond", exc)
            poll_failed = True
            time.sleep(0.001)
        try:
            os.read(efd, 8)
        except BlockingIOError:
            pass
        engine = engine_ref()
        if engine is None:
            rio.exit()
            os.close(efd)
            return
        done = engine._reap_once()
        # entries the kernel refused for now (EAGAIN / EBUSY) are retried in a millisecond,
        # even if no completion comes to wake us
        timeout = 1 if engine._resubmit else None  # ms
        if done:
            engine._reaper_exit()
        del engine
        if done:
            return


class UringEngine(Engine):
    """One ring of ``queue_depth`` entries and one reaper thread."""

    name = "uring"

    def __init__(self, *, queue_depth: int = 32, block_size: int = 1 << 20, direct: Optional[bool] = None) -> None:
        super().__init__(queue_depth=queue_depth, block_size=block_size, direct=direct)
        if not hasattr(os, "eventfd"):
            raise RuntimeError("the uring engine needs os.eventfd (Python 3.10+)")
        kind = ring_kind()
        if kind is None:
            raise RuntimeError(f"io_uring is unavailable here: {uring_unavailable_reason()}")
        entries = 1 << max(0, (queue_depth - 1).bit_length())
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._rio = LiburingRing(entries, self._efd, queue_depth) if kind == "liburing" \
                else NativeRing(entries, self._efd)
        except BaseException:
            os.close(self._efd)
            raise
        self.ring_kind = kind
        """Which ring: "liburing" (python-liburing) or "native" ([Note: native ring])."""
        self._fixed: Optional[_FixedTable] = None  # see [Note: fixed buffers]
        self._fixed_reason: Optional[str] = None  # why fixed buffers are off, once known
        self._refusal: Optional[str] = None  # why the last registration was refused
        self._logged_reason: Optional[str] = None
        self._handles: Dict[int, List[int]] = {}
        self._dontfork: Dict[int, List[Tuple[int, int]]] = {}  # handle -> spans left out of fork()
        self._next_handle = 1
        self._fixed_pieces = 0  # pieces sent through a registered buffer (stats)
        self._lock = threading.Lock()
        self._pending: Deque[_Piece] = deque()
        self._inflight: Dict[int, _Piece] = {}
        self._next_ud = 1
        self._stop = False
        self._resubmit = False  # the kernel refused queued entries for now: submit them again
        self._reaper_done = False
        self._reaper_tears_down = False  # close() was interrupted: the reaper releases the ring
        self._torn_down = False
        self._broken: Optional[BaseException] = None
        # The reaper holds only a weak reference, so an engine dropped without close() is still
        # collected: its finalizer pokes the eventfd and the reaper tears the ring down.
        self._thread = threading.Thread(target=_reaper_main, args=(weakref.ref(self), self._rio, self._efd),
                                        name="offload-uring-reaper", daemon=True)
        self._finalizer = weakref.finalize(self, os.eventfd_write, self._efd, 1)
        self._thread.start()

    # -- submission -------------------------------------------------------------------------

    def _issue(self, pieces: List[_Piece]) -> None:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"uring engine is broken: {self._broken}")
            if self._stop:  # close() ran after submit's own check: nobody would reap these
                raise ValueError(f"{self.name} engine is closed")
            self._pending.extend(pieces)
            # under the lock: close() cannot have closed the eventfd (whose number another
            # file might then hold) between the check above and this write
            os.eventfd_write(self._efd, 1)  # the reaper submits: see [Note: who submits]

    def _fill_locked(self) -> None:
        """Prepare pending pieces up to ``queue_depth`` in flight; one submit syscall for all."""
        rio = self._rio
        prepared = 0
        while self._pending and len(self._inflight) < self.queue_depth:
            piece = self._pending.popleft()
            if piece.ticket.error is not None:  # a sibling failed: drop the rest of the batch
                self._piece_done(piece, None)
                continue
            try:
                fd = piece.fd()
            except OSError as exc:
                self._piece_done(piece, piece.error(exc.errno or errno.EBADF))
                continue
            addr, nbytes = piece.addr + piece.done, piece.nbytes - piece.done
            buf_index = self._fixed.lookup(addr, nbytes) if self._fixed is not None else -1
            ud = self._next_ud
            if not rio.prep(piece, piece.write, fd, addr, nbytes, piece.offset + piece.done, ud, buf_index):
                self._pending.appendleft(piece)  # the SQ ring is full
                break
            self._next_ud += 1
            if buf_index >= 0:
                self._fixed_pieces += 1
            self._inflight[ud] = piece
            if not piece.t_issue:
                piece.t_issue = time.perf_counter_ns()
            prepared += 1
        if prepared:
            self._note_inflight(len(self._inflight))
        if prepared or self._resubmit:
            self._submit_locked()

    def _submit_locked(self) -> None:
        try:
            self._rio.submit()
            self._resubmit = False
        except OSError as exc:
            if exc.errno not in _RETRY:
                raise
            # EAGAIN/EBUSY: the kernel is short of resources or the CQ is full; the prepared
            # SQEs stay in the ring, and the reaper submits them again (within a millisecond,
            # or at the next completion), never leaving them queued with no one to submit.
            self._resubmit = True

    # -- registered buffers -----------------------------------------------------------------

    def _fixed_supported(self) -> Optional[str]:
        """None when this ring and kernel can send requests through registered buffers, else why not."""
        return self._rio.fixed_reason()

    def register_buffers(self, buffers: Sequence[Any]) -> Optional[int]:
        """Page-pin ``buffers`` in the ring so requests into them skip per-request pinning.

        Returns a handle for :meth:`unregister_buffers`, or None when fixed buffers are not
        available here (the reason is logged once and kept in :attr:`fixed_buffers_reason`);
        I/O works either way.
        """
        spans: List[Tuple[int, int]] = []
        for buf in buffers:
            with as_bytes_view(buf, writable=False) as mv:  # released at once: no export left on the pool
                addr, left = _address(mv), len(mv)
            while left > 0:
                n = min(left, _FIXED_MAX_BYTES)
                spans.append((addr, n))
                addr += n
                left -= n
        if not spans:
            return None
        with self._lock:
            if self._broken is not None or self._stop:
                raise RuntimeError("register_buffers on a closed or broken uring engine")
            if self._fixed_reason is None and self._fixed is None:
                self._fixed_reason = self._fixed_supported()
                if self._fixed_reason is None:
                    # _ring_register looked up here, at first use: tests replace it on this module
                    self._fixed = _FixedTable(self._rio.fd, _ring_register)
            if self._fixed is None:
                reason = self._fixed_reason
            else:
                try:
                    slots = self._fixed.add(spans)
                except OSError as exc:
                    reason = f"io_uring_register failed: {exc.strerror}" + (
                        " (pinned pages count against RLIMIT_MEMLOCK; raise `ulimit -l`)"
                        if exc.errno == errno.ENOMEM else "")
                else:
                    self._refusal = None
                    handle = self._next_handle
                    self._next_handle += 1
                    self._handles[handle] = slots
                    self._dontfork[handle] = _set_dontfork(spans, True)
                    return handle
        if self._fixed is not None:
            self._refusal = reason
        if reason != self._logged_reason:  # once per distinct reason, not per call
            self._logged_reason = reason
            log.info("uring: registered buffers not used: %s", reason)
        return None

    @property
    def fixed_buffers_reason(self) -> Optional[str]:
        """Why registered buffers are not used (None: in use, or not asked for yet); after a
        refused registration (RLIMIT_MEMLOCK, a full table), why that one was refused."""
        return self._fixed_reason if self._fixed is None else self._refusal

    def unregister_buffers(self, handle: Optional[int]) -> None:
        """Release what :meth:`register_buffers` pinned; requests in flight finish first."""
        if handle is None or os.getpid() != self._owner_pid:
            return  # a forked child: the ring, and what is registered in it, are the parent's
        with self._lock:
            slots = self._handles.pop(handle, None)
            if slots and self._fixed is not None and not self._stop:
                self._fixed.remove(slots)
            _set_dontfork(self._dontfork.pop(handle, []), False)

    def stats(self) -> Dict[str, int]:
        out = super().stats()
        out["fixed_pieces"] = self._fixed_pieces
        return out

    # -- completion -------------------------------------------------------------------------

    def _reap_once(self) -> bool:
        """Drain completions and refill; True when the reaper should stop (after close)."""
        try:
            with self._lock:
                self._reap_locked()
                return self._stop and not self._inflight and not self._pending and not self._resubmit
        except BaseException as exc:  # pragma: no cover - a bug here must not hang waiters
            log.exception("uring reaper failed")
            self._fail_all(exc)
            return True

    def _reap_locked(self) -> None:
        for ud, res, err in self._rio.completions():
            piece = self._inflight.pop(ud, None)
            if piece is None:
                log.error("uring: completion for unknown request %d (res=%s)", ud, res)
                continue
            self._rio.release(piece)
            piece.keep = None
            if err:
                if err in _RETRY:
                    self._count_resubmit()
                    self._pending.appendleft(piece)
                else:
                    self._piece_done(piece, piece.error(err))
            elif res == 0:
                self._piece_done(piece, piece.error(errno.EIO) if piece.write else None)
            else:
                piece.done += res
                if piece.done < piece.nbytes:
                    # Short transfer: the rest goes back to the front of the queue.
                    self._count_resubmit()
                    self._pending.appendleft(piece)
                else:
                    self._piece_done(piece, None)
        self._fill_locked()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._broken = exc
            pieces = list(self._inflight.values()) + list(self._pending)
            self._inflight.clear()
            self._pending.clear()
        for piece in pieces:
            self._piece_done(piece, OSError(errno.EIO, f"uring engine failed: {exc}", piece.file.path))

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish in-flight work, stop the reaper, tear the ring down. Idempotent."""
        if self._closed:
            return
        super().close()
        self._finalizer.detach()
        if os.getpid() != self._owner_pid:
            # A forked child: the reaper thread, the ring and the lock (which that thread may
            # have held at fork(), with no one left to release it) are the parent's. Closing
            # is only refusing further use here.
            return
        with self._lock:
            self._stop = True
            os.eventfd_write(self._efd, 1)
        if self._thread is not threading.current_thread():
            try:
                self._thread.join()
            except BaseException:
                # Ctrl-C while the I/O in flight finishes: the reaper releases the ring when
                # it is done (the kernel still writes into the callers' buffers until then)
                with self._lock:
                    self._reaper_tears_down = True
                    done = self._reaper_done
                if done:
                    self._teardown()
                raise
        self._teardown()

    def _reaper_exit(self) -> None:
        """The reaper's last act after close(): tear down if close() could not wait for it."""
        with self._lock:
            self._reaper_done = True
            tear = self._reaper_tears_down
        if tear:
            self._teardown()

    def _teardown(self) -> None:
        if not self._torn_down:
            self._torn_down = True
            self._rio.exit()
            os.close(self._efd)
