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
``user_data`` first. Registered files would save an fdget per request, which is noise at
128 KiB+, so they are not used.

[Note: fixed buffers] ``register_buffers`` page-pins a caller's long-lived buffers (the swap
pipeline's, bench-io's) once, so a request into them skips pinning and unpinning its pages
(``get_user_pages``) on every submission. The binding's fixed-buffer calls take only a
``bytearray``, so the table is managed with the raw ``io_uring_register`` syscall: a sparse
table (``IORING_REGISTER_BUFFERS2``, kernel 5.19+) whose slots are filled and cleared with
``IORING_REGISTER_BUFFERS_UPDATE``, which is safe with requests in flight (the kernel keeps
a removed buffer until its last request completes). A piece whose memory lies inside a
registered slot goes out as ``IORING_OP_READV_FIXED`` / ``WRITEV_FIXED`` (kernel 6.15+,
probed) through the same rewritable ``Iovec``; anything else, or a kernel without those
opcodes, goes out as before. The kernel takes at most 1 GiB per slot, so larger buffers
take several. Pinned pages count against ``RLIMIT_MEMLOCK`` for users without
CAP_IPC_LOCK: a refused registration is logged once and the engine simply does not use
fixed buffers. Callers unregister before they unmap (``BufferPool.close``), else the pinned
pages stay allocated until the engine closes. Registered whole-page buffers are marked
``MADV_DONTFORK`` while registered: fork() would otherwise copy every pinned page into the
child (a DataLoader worker) at once.
"""
from __future__ import annotations

import bisect
import ctypes
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

__all__ = ["UringEngine", "uring_unavailable_reason"]

log = logging.getLogger(__name__)

_RETRY = (errno.EINTR, errno.EAGAIN, errno.EBUSY)


class _CIovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_HEADER = object.__basicsize__  # PyObject header: refcount and type pointer

# io_uring_register(2): the syscall number is the same on every architecture (io_uring came
# after the syscall tables were unified); opcodes and structs from <linux/io_uring.h>.
_SYS_IO_URING_REGISTER = 427
_IORING_REGISTER_BUFFERS2 = 15
_IORING_REGISTER_BUFFERS_UPDATE = 16
_IORING_RSRC_REGISTER_SPARSE = 1
_IORING_OP_READV_FIXED = 60  # enum io_uring_op (the binding does not export the opcodes)
_IORING_OP_WRITEV_FIXED = 61
_FIXED_SLOTS = 256  # table size (a sparse table pins nothing): bench-io registers 2 x QD buffers
_FIXED_MAX_BYTES = 1 << 30  # the kernel's limit for one registered buffer


class _RsrcRegister(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("resv2", ctypes.c_uint64),
                ("data", ctypes.c_uint64), ("tags", ctypes.c_uint64)]


class _RsrcUpdate2(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint32), ("resv", ctypes.c_uint32), ("data", ctypes.c_uint64),
                ("tags", ctypes.c_uint64), ("nr", ctypes.c_uint32), ("resv2", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTFORK, _MADV_DOFORK = 10, 11
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _set_dontfork(spans: Sequence[Tuple[int, int]], on: bool) -> List[Tuple[int, int]]:
    """MADV_DONTFORK (or back) on the whole-page spans; returns the spans it applied to.

    Pinned pages cannot be shared copy-on-write, so fork() copies every registered page into
    the child at once (measured here: 160 MiB registered made fork() 215-237 ms instead of
    34-45 ms, for each DataLoader worker). A child never uses our I/O buffers, so they are
    left out of it. Only spans of whole pages: a partial page holds other data the child needs.
    """
    done = []
    for addr, n in spans:
        if addr % _PAGE or n % _PAGE:
            continue
        if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), _MADV_DONTFORK if on else _MADV_DOFORK) == 0:
            done.append((addr, n))
        else:
            log.debug("madvise(%s) of %d bytes failed: %s", "MADV_DONTFORK" if on else "MADV_DOFORK", n,
                      os.strerror(ctypes.get_errno()))
    return done


def _ring_register(ring_fd: int, opcode: int, arg: Any, nr_args: int) -> int:
    """``io_uring_register(ring_fd, opcode, arg, nr_args)``; raises OSError on failure."""
    rc = _libc.syscall(ctypes.c_long(_SYS_IO_URING_REGISTER), ctypes.c_int(ring_fd), ctypes.c_uint(opcode),
                       ctypes.c_void_p(ctypes.addressof(arg)), ctypes.c_uint(nr_args))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


class _FixedTable:
    """The ring's sparse table of registered buffers and an address -> slot lookup.

    All methods run under the engine's lock. See [Note: fixed buffers].
    """

    def __init__(self, ring_fd: int) -> None:
        self._fd = ring_fd
        self._ready = False
        self._free = list(range(_FIXED_SLOTS - 1, -1, -1))
        self._starts: List[int] = []  # sorted slot start addresses
        self._spans: List[Tuple[int, int, int]] = []  # (start, end, slot), same order

    def _set(self, slot: int, addr: int, nbytes: int) -> None:
        iov = _CIovec(addr, nbytes)
        up = _RsrcUpdate2(offset=slot, data=ctypes.addressof(iov), nr=1)
        _ring_register(self._fd, _IORING_REGISTER_BUFFERS_UPDATE, up, ctypes.sizeof(up))

    def add(self, spans: Sequence[Tuple[int, int]]) -> List[int]:
        """Register ``(addr, nbytes)`` spans (each <= 1 GiB); all or none. Returns the slots."""
        if not self._ready:
            reg = _RsrcRegister(nr=_FIXED_SLOTS, flags=_IORING_RSRC_REGISTER_SPARSE)
            _ring_register(self._fd, _IORING_REGISTER_BUFFERS2, reg, ctypes.sizeof(reg))
            self._ready = True
        if len(spans) > len(self._free):
            raise OSError(errno.ENOSPC, f"the ring's table of {_FIXED_SLOTS} registered buffers is full")
        taken: List[int] = []
        try:
            for addr, nbytes in spans:
                slot = self._free.pop()
                taken.append(slot)
                self._set(slot, addr, nbytes)
                i = bisect.bisect(self._starts, addr)
                self._starts.insert(i, addr)
                self._spans.insert(i, (addr, addr + nbytes, slot))
        except BaseException:
            self.remove(taken)
            raise
        return taken

    def remove(self, slots: Sequence[int]) -> None:
        drop = set(slots)
        for slot in drop:
            try:
                self._set(slot, 0, 0)
            except OSError as exc:  # the slot stays pinned until the ring goes; say so
                log.warning("uring: clearing registered buffer %d failed: %s", slot, exc)
            self._free.append(slot)
        keep = [(a, e, s) for a, e, s in self._spans if s not in drop]
        self._spans = keep
        self._starts = [a for a, _, _ in keep]

    def lookup(self, addr: int, nbytes: int) -> int:
        """The slot holding all of ``[addr, addr + nbytes)``, or -1."""
        i = bisect.bisect(self._starts, addr) - 1
        if i >= 0:
            start, end, slot = self._spans[i]
            if addr + nbytes <= end:
                return slot
        return -1


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
        self._fixed: Optional[_FixedTable] = None  # see [Note: fixed buffers]
        self._fixed_reason: Optional[str] = None  # why fixed buffers are off, once known
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
            addr, nbytes = piece.addr + piece.done, piece.nbytes - piece.done
            slot = self._slots.take(addr, nbytes)
            piece.keep = slot
            buf_index = self._fixed.lookup(addr, nbytes) if self._fixed is not None else -1
            if buf_index >= 0:
                self._fixed_pieces += 1
                if piece.write:
                    L.io_uring_prep_writev_fixed(sqe, fd, slot[0], buf_index, piece.offset + piece.done)
                else:
                    L.io_uring_prep_readv_fixed(sqe, fd, slot[0], buf_index, piece.offset + piece.done)
            elif piece.write:
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

    # -- registered buffers -----------------------------------------------------------------

    def _fixed_supported(self) -> Optional[str]:
        """None when this kernel has READV_FIXED and WRITEV_FIXED, else why not."""
        L = self._L
        op_r, op_w = _IORING_OP_READV_FIXED, _IORING_OP_WRITEV_FIXED
        if not (hasattr(L, "io_uring_prep_readv_fixed") and hasattr(L, "io_uring_prep_writev_fixed")):
            return "python-liburing lacks io_uring_prep_readv_fixed / writev_fixed"
        probe = L.io_uring_get_probe_ring(self._ring)
        if probe is None:
            return "the kernel's io_uring probe failed"
        try:
            if not (L.io_uring_opcode_supported(probe, op_r) and L.io_uring_opcode_supported(probe, op_w)):
                return "the kernel lacks IORING_OP_READV_FIXED / WRITEV_FIXED (Linux 6.15+)"
        finally:
            L.io_uring_free_probe(probe)
        return None

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
                    self._fixed = _FixedTable(self._ring.ring_fd)
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
                    handle = self._next_handle
                    self._next_handle += 1
                    self._handles[handle] = slots
                    self._dontfork[handle] = _set_dontfork(spans, True)
                    return handle
        if reason != self._logged_reason:  # once per distinct reason, not per call
            self._logged_reason = reason
            log.info("uring: registered buffers not used: %s", reason)
        return None

    @property
    def fixed_buffers_reason(self) -> Optional[str]:
        """Why registered buffers are not used (None: in use, or not asked for yet)."""
        return self._fixed_reason if self._fixed is None else None

    def unregister_buffers(self, handle: Optional[int]) -> None:
        """Release what :meth:`register_buffers` pinned; requests in flight finish first."""
        if handle is None:
            return
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
