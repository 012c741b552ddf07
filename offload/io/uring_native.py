"""The ``uring`` engine's ring over raw syscalls (native/uring_ring.cpp), for machines where
python-liburing cannot run.

[Note: native ring] python-liburing 2026.3.x dies of SIGILL on CPUs without AVX-512
([Note: binding probed in a child] in uring_ring.py), which took io_uring away from every
AVX2-only machine. This ring is the library's own: about two hundred lines of C++ in
liboffload_native.so that set the ring up with ``io_uring_setup`` and ``mmap``, write SQEs
(``IORING_OP_READ`` / ``WRITE``, Linux 5.6, with the address and length in the SQE: no iovec
to keep alive; ``READ_FIXED`` / ``WRITE_FIXED`` for registered buffers) and read CQEs, called
through ctypes, which releases the GIL. The engine around it (``uring.UringEngine``: the
eventfd reaper, who submits, short transfers, registered buffers) is the same for both rings;
``OFFLOAD_URING_RING=native|liburing`` forces one (tests, benchmarks), the default takes
python-liburing where it runs and this ring elsewhere.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
from typing import Iterator, List, Optional, Tuple

__all__ = ["NativeRing", "native_ring_reason"]

_u32, _i32, _u64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64
_BATCH = 64  # completions read per call
_MAX_RW = 0x7FFFF000  # the kernel's most bytes per read/write (MAX_RW_COUNT); the SQE's len is 32-bit


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    """The kernels' library with the ring's functions declared; OSError saying why not."""
    from offload.kernels.native_backend import LIB_PATH

    if not os.path.exists(LIB_PATH):
        raise OSError(errno.ENOENT, f"{LIB_PATH} not found (the native library builds with `pip install .`)")
    lib = ctypes.CDLL(LIB_PATH)
    if not hasattr(lib, "offload_uring_open"):
        raise OSError(errno.ENOSYS, f"{LIB_PATH} has no io_uring ring (built before it): rebuild it")
    vp, P = ctypes.c_void_p, ctypes.POINTER
    lib.offload_uring_open.argtypes = [_u32, ctypes.c_int, P(vp)]
    lib.offload_uring_queue.argtypes = [vp, ctypes.c_int, P(_i32), P(_i32), P(_u64), P(_u32), P(_u64), P(_u64),
                                        P(_i32)]
    lib.offload_uring_submit.argtypes = [vp]
    lib.offload_uring_reap.argtypes = [vp, ctypes.c_int, P(_u64), P(_i32)]
    lib.offload_uring_fd.argtypes = [vp]
    lib.offload_uring_close.argtypes = [vp]
    lib.offload_uring_close.restype = None
    for name in ("open", "queue", "submit", "reap", "fd"):
        getattr(lib, f"offload_uring_{name}").restype = ctypes.c_int
    return lib


class NativeRing:
    """One ring of ``entries`` SQEs whose completions signal ``efd``; used under the engine's lock."""

    kind = "native"

    def __init__(self, entries: int, efd: int) -> None:
        self._lib = _lib()
        handle = ctypes.c_void_p()
        rc = self._lib.offload_uring_open(entries, efd, ctypes.byref(handle))
        if rc != 0:
            limit = " (the kernel takes at most 32768 entries: a smaller queue_depth)" \
                if rc == -errno.EINVAL and entries > 32768 else ""
            raise OSError(-rc, f"io_uring ring set-up ({entries} entries, io_uring_setup and "
                               f"IORING_REGISTER_EVENTFD) failed: {os.strerror(-rc)}{limit}", "io_uring")
        self._h = handle
        self.fd = self._lib.offload_uring_fd(handle)
        self._batch: List[Tuple[int, int, int, int, int, int, int]] = []
        self._ud = (_u64 * _BATCH)()
        self._res = (_i32 * _BATCH)()

    def prep(self, piece, write: bool, fd: int, addr: int, nbytes: int, offset: int, ud: int,
             buf_index: int) -> bool:
        """Stage one request for ``submit`` (always room: the engine keeps at most
        ``queue_depth`` <= ``entries`` in flight). A piece of more than ``_MAX_RW`` bytes goes
        out as a short transfer, whose rest the engine resubmits (the kernel would cut it so)."""
        self._batch.append((int(write), fd, addr, min(nbytes, _MAX_RW), offset, ud, buf_index))
        return True

    def submit(self) -> None:
        """Queue the staged requests and hand every queued one to the kernel; OSError(EAGAIN /
        EBUSY) leaves them queued for the next call."""
        if self._batch:
            n = len(self._batch)
            cols = list(zip(*self._batch))
            arrays = [(_i32 * n)(*cols[0]), (_i32 * n)(*cols[1]), (_u64 * n)(*cols[2]), (_u32 * n)(*cols[3]),
                      (_u64 * n)(*cols[4]), (_u64 * n)(*cols[5]), (_i32 * n)(*cols[6])]
            queued = self._lib.offload_uring_queue(self._h, n, *arrays)
            self._batch = []  # what was queued is in the ring: never queue it twice
            if queued != n:  # the engine bounds what is in flight by the ring's size
                raise OSError(errno.EOVERFLOW if queued >= 0 else -queued,
                              f"native io_uring ring took {queued} of {n} requests")
        rc = self._lib.offload_uring_submit(self._h)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def completions(self) -> Iterator[Tuple[int, int, int]]:
        """(user_data, bytes, errno) of every completion posted so far."""
        while True:
            n = self._lib.offload_uring_reap(self._h, _BATCH, self._ud, self._res)
            for i in range(n):
                res = self._res[i]
                yield self._ud[i], (res if res >= 0 else -1), (-res if res < 0 else 0)
            if n < _BATCH:
                return

    def release(self, piece) -> None:
        """Nothing per request (the address and length travel in the SQE)."""

    def fixed_reason(self) -> Optional[str]:
        """None: READ_FIXED / WRITE_FIXED date from Linux 5.1; the sparse table's own
        registration (5.19+) says so if this kernel lacks it."""
        return None

    def exit(self) -> None:
        if self._h:
            self._lib.offload_uring_close(self._h)
            self._h = ctypes.c_void_p()


_VERDICT: List[Optional[str]] = []  # the probe's answer, once it is not a passing shortage
_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN)


def native_ring_reason() -> Optional[str]:
    """None if the native ring works here (a read of /dev/zero through it), else why not.
    Kept for the process, unless the probe failed for want of descriptors or memory."""
    if _VERDICT:
        return _VERDICT[0]
    try:
        why = _probe()
    except OSError as exc:
        if exc.errno in _TRANSIENT:
            return f"the native ring could not be probed: {exc.strerror or exc}"
        why = f"native io_uring ring: {exc.strerror or exc}"
    _VERDICT.append(why)
    return why


def _probe() -> Optional[str]:
    """Why the ring cannot run here, or None; OSError for a shortage worth probing again."""
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        ring = NativeRing(2, efd)
    except OSError as exc:
        os.close(efd)
        if exc.errno in _TRANSIENT:
            raise
        return (f"{exc.strerror or exc} (io_uring disabled by sysctl kernel.io_uring_disabled, or blocked by a "
                "seccomp filter)" if exc.filename == "io_uring" else str(exc.strerror or exc))
    try:
        fd = os.open("/dev/zero", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        ring.exit()
        os.close(efd)
        raise
    buf = ctypes.create_string_buffer(4096)
    try:
        ring.prep(None, False, fd, ctypes.addressof(buf), 4096, 0, 7, -1)
        ring.submit()
        for _ in range(1000):
            got = list(ring.completions())
            if got:
                return None if got == [(7, 4096, 0)] else f"native io_uring ring: unexpected completion {got}"
            os.read(efd, 8) if _readable(efd) else None
        return "native io_uring ring: no completion for a read of /dev/zero"
    except OSError as exc:
        if exc.errno in _TRANSIENT:
            raise
        return f"native io_uring ring: {exc}"
    finally:
        ring.exit()
        os.close(fd)
        os.close(efd)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.01)[0])
