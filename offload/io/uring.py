"""The ``uring`` engine: io_uring through python-liburing, completions reaped off the GIL.

[Note: waiting without the GIL] python-liburing holds the GIL inside ``io_uring_wait_cqe``
(another Python thread ran at 3-5 % of its speed during a 1 s wait). So the ring signals an
eventfd (``io_uring_register_eventfd``) and a reaper thread sleeps in ``select`` on it, which
releases the GIL; it then drains completions with ``io_uring_peek_cqe`` /
``io_uring_cq_advance``, resubmits short transfers, refills the queue up to ``queue_depth``
and completes tickets. Callers ``wait`` on a ``threading.Event``. A consequence: the queue is
refilled as completions arrive even while the submitting thread computes, which is what the
swap pipeline needs (submit now, wait later).

[Note: who submits] Only the reaper thread calls ``io_uring_submit``; ``submit`` queues the
pieces and pokes the eventfd. io_uring completes a request through task_work of the thread
that submitted it, which runs when that thread enters the kernel: a submitter that then
computes (a native Adam kernel, no syscalls for 100 ms) would hold back its own completions
until a timer tick (a request completed while its submitter spun in user space showed 4-8 ms
p99 here, against 0.15 ms when the submitter slept). The reaper sleeps in ``select`` whenever
it is idle, so completions are posted at once; and the compute thread never pays the
submission syscalls (inline O_DIRECT submission pins pages and builds bios).

[Note: binding traps] ``io_uring_prep_read`` takes only a ``bytearray`` (never aligned for
O_DIRECT), so we use ``prep_readv``/``prep_writev``, which take an ``Iovec``. But
``Iovec([memoryview])`` (liburing 2026.3.30) never releases the buffer it gets from the view:
every request would pin its memoryview, and through it the pool's mmap, forever (a leak, and
``BufferPool.close()`` could never unmap). So each ring slot owns one ``Iovec`` made once over
a private 1-byte anchor, and we rewrite its C ``struct iovec`` (``iov_base``, ``iov_len``)
through ctypes for each request; the piece keeps its real view alive until completion. The
layout (``_len`` then ``_iovec`` pointer after the object header) is verified when the engine
starts; if it ever differs we fall back to a ctypes array per request (leaks ~200 bytes per
request, logged). A negative ``res`` raises ``OSError`` when read from the CQE: we read
``user_data`` first. Registered (fixed) buffers need the ``bytearray`` API, so they are not
used; registered files would save an fdget per request, which is noise at 128 KiB+.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading
import time
import weakref
from collections import deque
from typing import Deque, Dict, List, Optional

from .engine import Engine, _Piece

__all__ = ["UringEngine", "uring_unavailable_reason"]

log = logging.getLogger(__name__)

_RETRY = (errno.EINTR, errno.EAGAIN, errno.EBUSY)


class _CIovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_HEADER = object.__basicsize__  # PyObject header: refcount and type pointer


class _IovecSlots:
    """``n`` reusable single-entry ``Iovec`` objects whose C iovec we rewrite (see the note)."""

    def __init__(self, L, n: int) -> None:
        self._L = L
        self._anchors = []
        self._free = []
        self.rewritable = True
        for _ in range(n):
            slot = self._make()
            if slot is None:
                self.rewritable = False
                self._free = []
                log.warning("python-liburing's Iovec layout is not the expected one: falling back to one "
                            "Iovec per request, which leaks a small object per request in that binding")
                break
            self._free.append(slot)

    def _make(self):
        anchor = bytearray(7)
        iov = self._L.Iovec([anchor])
        self._anchors.append(anchor)  # its buffer stays exported by the binding: keep it ours
        base = id(iov)
        n = ctypes.c_size_t.from_address(base + _HEADER).value
        arr = ctypes.c_void_p.from_address(base + _HEADER + ctypes.sizeof(ctypes.c_size_t)).value
        if n != 1 or not arr:
            return None
        c = _CIovec.from_address(arr)
        anchor_addr = ctypes.addressof(ctypes.c_char.from_buffer(anchor))
        if c.iov_base != anchor_addr or c.iov_len != 7:
            return None
        return iov, c

    def take(self, addr: int, nbytes: int):
        if self.rewritable:
            iov, c = self._free.pop()
            c.iov_base = addr
            c.iov_len = nbytes
            return (iov, c)
        arr = (ctypes.c_char * nbytes).from_address(addr)
        return (self._L.Iovec([arr]), None)

    def give(self, slot) -> None:
        if slot is not None and slot[1] is not None:
            slot[1].iov_len = 0
            self._free.append(slot)


def _liburing():
    try:
        import liburing
    except ImportError as exc:
        raise RuntimeError(f"python-liburing is not installed ({exc}); pip install liburing") from None
    return liburing


def uring_unavailable_reason() -> Optional[str]:
    """None if an io_uring ring can be set up here, else why not (probed, not guessed)."""
    if not hasattr(os, "eventfd"):
        return "os.eventfd needs Python 3.10+"
    try:
        L = _liburing()
    except RuntimeError as exc:
        return str(exc)
    ring = L.Ring()
    try:
        L.io_uring_queue_init(2, ring)
    except OSError as exc:
        return (f"io_uring_queue_init failed: {os.strerror(exc.errno or errno.ENOSYS)} "
                "(io_uring disabled by sysctl kernel.io_uring_disabled, or blocked by a seccomp filter)")
    L.io_uring_queue_exit(ring)
    return None


def _reaper_main(engine_ref, L, ring, efd: int) -> None:
    """The reaper thread: sleep in ``select`` (GIL released), then let the engine reap.

    Holds the engine only between a wake-up and the end of its reaping. If the engine was
    collected without ``close()``, tear its ring down here (nobody else is left to).
    """
    while True:
        try:
            select.select([efd], [], [])
        except InterruptedError:
            continue
        try:
            os.read(efd, 8)
        except BlockingIOError:
            pass
        engine = engine_ref()
        if engine is None:
            L.io_uring_queue_exit(ring)
            os.close(efd)
            return
        done = engine._reap_once()
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
        L = self._L = _liburing()
        self._ring = L.Ring()
        entries = 1 << max(0, (queue_depth - 1).bit_length())
        try:
            L.io_uring_queue_init(entries, self._ring)
        except OSError as exc:
            err = exc.errno or errno.ENOSYS
            raise OSError(err, f"io_uring_queue_init({entries}) failed: {os.strerror(err)} (io_uring disabled "
                               "or blocked by seccomp; use the threads engine)", "io_uring") from None
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            L.io_uring_register_eventfd(self._ring, self._efd)
        except OSError as exc:
            L.io_uring_queue_exit(self._ring)
            os.close(self._efd)
            raise OSError(exc.errno, f"io_uring_register_eventfd failed: {os.strerror(exc.errno)}",
                          "io_uring") from None
        self._cqe = L.Cqe()
        self._slots = _IovecSlots(L, queue_depth)
        self._lock = threading.Lock()
        self._pending: Deque[_Piece] = deque()
        self._inflight: Dict[int, _Piece] = {}
        self._next_ud = 1
        self._stop = False
        self._broken: Optional[BaseException] = None
        # The reaper holds only a weak reference, so an engine dropped without close() is still
        # collected: its finalizer pokes the eventfd and the reaper tears the ring down.
        self._thread = threading.Thread(target=_reaper_main, args=(weakref.ref(self), L, self._ring, self._efd),
                                        name="offload-uring-reaper", daemon=True)
        self._finalizer = weakref.finalize(self, os.eventfd_write, self._efd, 1)
        self._thread.start()

    # -- submission -------------------------------------------------------------------------

    def _issue(self, pieces: List[_Piece]) -> None:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"uring engine is broken: {self._broken}")
            self._pending.extend(pieces)
        os.eventfd_write(self._efd, 1)  # the reaper submits: see [Note: who submits]

    def _fill_locked(self) -> None:
        """Prepare pending pieces up to ``queue_depth`` in flight; one submit syscall for all."""
        L, ring = self._L, self._ring
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
            sqe = L.io_uring_get_sqe(ring)
            if sqe is None:
                self._pending.appendleft(piece)
                break
            slot = self._slots.take(piece.addr + piece.done, piece.nbytes - piece.done)
            piece.keep = slot
            if piece.write:
                L.io_uring_prep_writev(sqe, fd, slot[0], piece.offset + piece.done)
            else:
                L.io_uring_prep_readv(sqe, fd, slot[0], piece.offset + piece.done)
            ud = self._next_ud
            self._next_ud += 1
            L.io_uring_sqe_set_data64(sqe, ud)
            self._inflight[ud] = piece
            if not piece.t_issue:
                piece.t_issue = time.perf_counter_ns()
            prepared += 1
        if prepared:
            self._note_inflight(len(self._inflight))
            self._submit_locked()

    def _submit_locked(self) -> None:
        for _ in range(100):
            try:
                self._L.io_uring_submit(self._ring)
                return
            except OSError as exc:
                if exc.errno not in _RETRY:
                    raise
                # EAGAIN/EBUSY: the kernel is short of resources or the CQ is full; the
                # prepared SQEs stay in the ring and go with the next submit.
                if self._inflight:
                    return
                time.sleep(0.001)

    # -- completion -------------------------------------------------------------------------

    def _reap_once(self) -> bool:
        """Drain completions and refill; True when the reaper should stop (after close)."""
        try:
            with self._lock:
                self._reap_locked()
                return self._stop and not self._inflight and not self._pending
        except BaseException as exc:  # pragma: no cover - a bug here must not hang waiters
            log.exception("uring reaper failed")
            self._fail_all(exc)
            return True

    def _reap_locked(self) -> None:
        L, ring, cqe = self._L, self._ring, self._cqe
        while True:
            try:
                L.io_uring_peek_cqe(ring, cqe)
            except BlockingIOError:
                break
            entry = cqe[0]
            ud = entry.user_data
            try:
                res = entry.res  # the binding raises OSError for a negative res
                err = 0
            except OSError as exc:
                res, err = -1, exc.errno or errno.EIO
            L.io_uring_cq_advance(ring, 1)
            piece = self._inflight.pop(ud, None)
            if piece is None:
                log.error("uring: completion for unknown request %d (res=%s)", ud, res)
                continue
            self._slots.give(piece.keep)
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
        with self._lock:
            self._stop = True
        os.eventfd_write(self._efd, 1)
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._L.io_uring_queue_exit(self._ring)
        os.close(self._efd)
