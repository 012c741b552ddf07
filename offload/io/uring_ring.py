"""The ring side of the ``uring`` engine: what python-liburing cannot do by itself.

Reusable ``Iovec`` slots whose C iovec is rewritten per request, the table of registered
(fixed) buffers kept with the raw ``io_uring_register`` syscall, ``MADV_DONTFORK`` on the
registered pages, and the probe that says whether io_uring works here. The engine
(``uring.UringEngine``) drives these; they hold no thread and take no lock of their own.

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
import contextlib
import ctypes
import errno
import functools
import logging
import os
import signal
import subprocess
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["uring_unavailable_reason", "LiburingRing"]

log = logging.getLogger("offload.io.uring")  # one logger for the engine and its ring


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
_FIXED_SLOTS = 1024  # table size (a sparse table pins nothing): bench-io registers 2 x QD buffers (QD <= 512)
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
    the child at once, for each DataLoader worker (bench/RESULTS.md, Disk I/O). A child never uses our I/O buffers, so they are
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

    def __init__(self, ring_fd: int, register: Optional[Callable[[int, int, Any, int], int]] = None) -> None:
        self._fd = ring_fd
        # the io_uring_register call, given by the engine (a test gives one that refuses)
        self._register = register or _ring_register
        self._ready = False
        self._free = list(range(_FIXED_SLOTS - 1, -1, -1))
        self._starts: List[int] = []  # sorted slot start addresses
        self._spans: List[Tuple[int, int, int]] = []  # (start, end, slot), same order

    def _set(self, slot: int, addr: int, nbytes: int) -> None:
        iov = _CIovec(addr, nbytes)
        up = _RsrcUpdate2(offset=slot, data=ctypes.addressof(iov), nr=1)
        self._register(self._fd, _IORING_REGISTER_BUFFERS_UPDATE, up, ctypes.sizeof(up))

    def add(self, spans: Sequence[Tuple[int, int]]) -> List[int]:
        """Register ``(addr, nbytes)`` spans (each <= 1 GiB); all or none. Returns the slots."""
        if not self._ready:
            reg = _RsrcRegister(nr=_FIXED_SLOTS, flags=_IORING_RSRC_REGISTER_SPARSE)
            self._register(self._fd, _IORING_REGISTER_BUFFERS2, reg, ctypes.sizeof(reg))
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


# [Note: binding probed in a child] python-liburing 2026.3.x is built with Zig for AVX-512:
# ``liburing.Ring()`` executes ``vmovups %zmm0`` and the whole process dies of SIGILL on a CPU
# without it (an AMD EPYC with AVX2 only, 2026-12-03), where no ``try`` can catch it. So the
# binding's calls that the engine makes (ring set-up, a readv of /dev/zero through an Iovec, the
# CQE reap) run once per process in a child interpreter first; if that child dies of a signal,
# io_uring is "unavailable" with the reason and ``auto`` takes the threads engine. A kernel
# that refuses io_uring is not the child's business (exit 0 there): the in-process probe says so.
_BINDING_PROBE = """
import os, liburing as L
ring = L.Ring()
try:
    L.io_uring_queue_init(2, ring)
except OSError:
    raise SystemExit(0)
fd = os.open("/dev/zero", os.O_RDONLY)
buf = bytearray(4096)
iov = L.Iovec([buf])
sqe = L.io_uring_get_sqe(ring)
L.io_uring_prep_readv(sqe, fd, iov, 0)
L.io_uring_sqe_set_data64(sqe, 7)
L.io_uring_submit(ring)
cqe = L.Cqe()
L.io_uring_wait_cqe(ring, cqe)
assert cqe[0].user_data == 7 and cqe[0].res == 4096, (cqe[0].user_data, cqe[0].res)
L.io_uring_cq_advance(ring, 1)
L.io_uring_queue_exit(ring)
os.close(fd)
"""


@functools.lru_cache(maxsize=None)
def _binding_crash_reason() -> Optional[str]:
    """None unless python-liburing's calls kill a child interpreter; then why (cached per process,
    and inherited by forked children)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # find liburing where we found it
    try:
        proc = subprocess.run([sys.executable, "-c", _BINDING_PROBE], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        # No child to sacrifice (an embedded interpreter, a process limit, a sys.executable this
        # user may not run): an in-process probe would be the very SIGILL the child exists to take,
        # so the binding is not used (the native ring serves instead).
        return f"python-liburing was not probed: no child interpreter could run its calls ({exc})"
    if proc.returncode == 0:
        return None
    try:
        from importlib.metadata import version

        ver = version("liburing")
    except Exception:
        ver = "?"
    if proc.returncode < 0:
        sig = -proc.returncode
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        why = f"python-liburing {ver} killed a probe process with {name}"
        if sig == signal.SIGILL:
            why += (" (illegal instruction: its wheel was built for CPU instructions this machine lacks; the "
                    "2026.3.x wheels need AVX-512)")
        return why
    tail = proc.stderr.decode(errors="replace").strip().splitlines()
    return f"python-liburing {ver} failed its probe (exit {proc.returncode}: {tail[-1] if tail else 'no message'})"


def _liburing():
    try:
        import liburing
    except ImportError as exc:
        raise RuntimeError(f"python-liburing is not installed ({exc}); pip install liburing") from None
    crash = _binding_crash_reason()
    if crash is not None:
        raise RuntimeError(crash)
    return liburing


@contextlib.contextmanager
def fd0_taken():
    """With fd 0 closed (a daemon, ``cmd <&-``) the next file opened is fd 0, and python-liburing
    takes a ring on fd 0 for one never set up (``io_uring_queue_exit(ring)`` "not initialized",
    so `offload info` failed and the engine could not be made): /dev/null holds fd 0 while a
    ring is made, and is closed after."""
    held = -1
    try:
        os.fstat(0)
    except OSError:
        held = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield
    finally:
        if held >= 0:
            os.close(held)


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
        with fd0_taken():
            L.io_uring_queue_init(2, ring)
    except OSError as exc:
        return (f"io_uring_queue_init failed: {os.strerror(exc.errno or errno.ENOSYS)} "
                "(io_uring disabled by sysctl kernel.io_uring_disabled, or blocked by a seccomp filter)")
    L.io_uring_queue_exit(ring)
    return None


class LiburingRing:
    """The ring through python-liburing: what ``UringEngine`` calls, as ``NativeRing`` offers it
    (uring_native.py). Used under the engine's lock."""

    kind = "liburing"

    def __init__(self, entries: int, efd: int, queue_depth: int) -> None:
        L = self._L = _liburing()
        self._ring = L.Ring()
        try:
            with fd0_taken():
                L.io_uring_queue_init(entries, self._ring)
        except OSError as exc:
            err = exc.errno or errno.ENOSYS
            raise OSError(err, f"io_uring_queue_init({entries}) failed: {os.strerror(err)} (io_uring disabled "
                               "or blocked by seccomp; use the threads engine)", "io_uring") from None
        try:
            L.io_uring_register_eventfd(self._ring, efd)
        except OSError as exc:
            L.io_uring_queue_exit(self._ring)
            raise OSError(exc.errno, f"io_uring_register_eventfd failed: {os.strerror(exc.errno)}",
                          "io_uring") from None
        self._cqe = L.Cqe()
        self._slots = _IovecSlots(L, queue_depth)
        self.fd = self._ring.ring_fd

    def prep(self, piece, write: bool, fd: int, addr: int, nbytes: int, offset: int, ud: int,
             buf_index: int) -> bool:
        """One SQE for ``piece``'s rest; False when the SQ ring is full."""
        L, ring = self._L, self._ring
        sqe = L.io_uring_get_sqe(ring)
        if sqe is None:
            return False
        slot = self._slots.take(addr, nbytes)
        piece.keep = slot
        if buf_index >= 0:
            (L.io_uring_prep_writev_fixed if write else L.io_uring_prep_readv_fixed)(sqe, fd, slot[0], buf_index,
                                                                                    offset)
        elif write:
            L.io_uring_prep_writev(sqe, fd, slot[0], offset)
        else:
            L.io_uring_prep_readv(sqe, fd, slot[0], offset)
        L.io_uring_sqe_set_data64(sqe, ud)
        return True

    def submit(self) -> None:
        self._L.io_uring_submit(self._ring)

    def completions(self):
        """(user_data, bytes, errno) of every completion posted so far."""
        L, ring, cqe = self._L, self._ring, self._cqe
        while True:
            try:
                L.io_uring_peek_cqe(ring, cqe)
            except BlockingIOError:
                return
            entry = cqe[0]
            ud = entry.user_data
            try:
                res = entry.res  # the binding raises OSError for a negative res
                err = 0
            except OSError as exc:
                res, err = -1, exc.errno or errno.EIO
            L.io_uring_cq_advance(ring, 1)
            yield ud, res, err

    def release(self, piece) -> None:
        self._slots.give(piece.keep)

    def fixed_reason(self) -> Optional[str]:
        """None when this kernel has READV_FIXED and WRITEV_FIXED, else why not."""
        L = self._L
        if not (hasattr(L, "io_uring_prep_readv_fixed") and hasattr(L, "io_uring_prep_writev_fixed")):
            return "python-liburing lacks io_uring_prep_readv_fixed / writev_fixed"
        probe = L.io_uring_get_probe_ring(self._ring)
        if probe is None:
            return "the kernel's io_uring probe failed"
        try:
            if not (L.io_uring_opcode_supported(probe, _IORING_OP_READV_FIXED)
                    and L.io_uring_opcode_supported(probe, _IORING_OP_WRITEV_FIXED)):
                return "the kernel lacks IORING_OP_READV_FIXED / WRITEV_FIXED (Linux 6.15+)"
        finally:
            L.io_uring_free_probe(probe)
        return None

    def exit(self) -> None:
        self._L.io_uring_queue_exit(self._ring)
