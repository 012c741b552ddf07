"""One large anonymous mapping: 2 MiB-aligned, advised for huge pages, optionally pinned.

[Note: why huge pages] On the virtio disk of our machines, fio with 1 MiB O_DIRECT requests
reads 1.1 GB/s from 4 KiB-page buffers and 2.4 GB/s from huge-page buffers (writes 2.5 vs
6 GB/s): physically contiguous buffers let the block layer merge requests (0.55 MiB vs
3.2 MiB per request in /proc/diskstats). THP is in ``madvise`` mode there, so a mapping gets
huge pages only if it is private, 2 MiB-aligned and advised *before* its first touch.
Python's ``mmap.mmap(-1, n)`` is a shared mapping, which never gets them: we map
``MAP_PRIVATE | MAP_ANONYMOUS``.

[Note: unmapping with live views] A region is a Python ``mmap`` object. Every view handed
out (a memoryview slice, a tensor from ``torch.frombuffer``) holds a buffer export on it, and
``mmap.close()`` refuses (``BufferError``) while any exists. So closing can never unmap memory
that a tensor still points at; the pool turns the refusal into a clear message.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import re
from typing import Any, Optional

__all__ = ["HUGE_PAGE", "PAGE", "Region", "anon_huge_bytes", "cuda_pin_available", "resident_pages"]

log = logging.getLogger(__name__)

PAGE = 4096
HUGE_PAGE = 2 << 20


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cuda_pin_available() -> bool:
    """True when torch sees a CUDA device, i.e. page-locking buffers buys async copies."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch without CUDA support raises various errors here
        return False


_MINCORE: list = []  # libc's mincore, looked up once (None where there is none)


def resident_pages(address: int, nbytes: int) -> Optional[bytes]:
    """Per 4 KiB page of ``[address, address + nbytes)`` (``address`` page-aligned), whether it
    is mapped in RAM (``mincore(2)``: a page read since it was dropped, which maps the zero
    page, counts too); None where that cannot be told (no mincore, pages of another size)."""
    if not _MINCORE:
        try:
            f = ctypes.CDLL(None, use_errno=True).mincore
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
            f.restype = ctypes.c_int
        except (OSError, AttributeError):
            f = None
        _MINCORE.append(f if mmap.PAGESIZE == PAGE else None)
    if _MINCORE[0] is None or nbytes <= 0:
        return None
    vec = (ctypes.c_ubyte * (-(-nbytes // PAGE)))()
    if _MINCORE[0](ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        return None
    return bytes(vec)


def _cudart():
    import torch

    return torch.cuda.cudart()


class Region:
    """``nbytes`` (rounded up to 2 MiB) of private anonymous memory starting on a 2 MiB boundary.

    ``huge``: ``madvise(MADV_HUGEPAGE)`` before the first touch. ``prefault``: touch every
    page now (one ``memset``, GIL released) so the first I/O does not pay page faults.
    ``pin``: ``cudaHostRegister`` the whole region (only call with CUDA present).
    """

    def __init__(self, nbytes: int, *, huge: bool = True, prefault: bool = True, pin: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"region size must be > 0, got {nbytes}")
        self.size = _round_up(nbytes, HUGE_PAGE)
        self.pinned = False
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        m = mmap.mmap(-1, self.size, flags=flags)
        addr = self._address(m)
        self.skip = (-addr) % HUGE_PAGE
        if self.skip:
            # The kernel aligns anonymous mappings whose length is a multiple of 2 MiB (6.7+);
            # older kernels do not: map 2 MiB more and start at the first boundary. The
            # untouched head costs address space only.
            m.close()
            m = mmap.mmap(-1, self.size + HUGE_PAGE, flags=flags)
            addr = self._address(m)
            self.skip = (-addr) % HUGE_PAGE
        self._mmap: Optional[mmap.mmap] = m
        self.address = addr + self.skip
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE, self.skip, self.size)
            except OSError as exc:  # THP compiled out: buffers still work, just slower I/O
                log.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
        # The base view every slice is cut from; released before the mmap is closed.
        self._view: Optional[memoryview] = memoryview(m)[self.skip:self.skip + self.size]
        if prefault:
            ctypes.memset(self.address, 0, self.size)
        if pin:
            try:
                self._pin()
            except BaseException:
                self._view.release()
                self._view = None
                m.close()
                self._mmap = None
                raise

    @staticmethod
    def _address(m: mmap.mmap) -> int:
        c = ctypes.c_char.from_buffer(m)
        try:
            return ctypes.addressof(c)
        finally:
            del c

    def _pin(self, rt: Any = None) -> None:
        # cudaHostRegisterDefault = 0; the error code is an enum whose int is 0 on success.
        # The runtime is kept for the unregister: looking it up again from a finalizer could
        # re-enter torch.cuda's lazy initialisation (under its lock) if that is under way.
        rt = rt or _cudart()
        err = rt.cudaHostRegister(self.address, self.size, 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister({self.size} bytes) failed with CUDA error {err}")
        self._rt = rt
        self.pinned = True
        # Pinned pages cannot be shared copy-on-write: fork() would copy the whole region into
        # every child (each DataLoader worker) at once, as it did for the io_uring registered
        # buffers (see [Note: fixed buffers] in offload/io/uring.py). No child uses our
        # buffers, so they are left out of it. (A pinned pool is never also registered with
        # io_uring, whose unregister would turn this off again.)
        if hasattr(mmap, "MADV_DONTFORK"):
            try:
                self._mmap.madvise(mmap.MADV_DONTFORK, self.skip, self.size)
            except OSError as exc:
                log.debug("madvise(MADV_DONTFORK) refused: %s", exc)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable memoryview of ``nbytes`` at ``offset`` (zero-copy)."""
        if self._view is None:
            raise ValueError("region is closed (its BufferPool was closed)")
        return self._view[offset:offset + nbytes]

    def close(self) -> None:
        """Unpin and unmap. Raises ``BufferError`` (nothing unmapped) while views are alive."""
        if self._mmap is None:
            return
        view = self._view
        self._view = None
        if view is not None:
            view.release()
        # CUDA wants memory unregistered before it is unmapped; if the unmap is then refused
        # (views alive), register it again so the region stays as it was.
        was_pinned = self.pinned
        if was_pinned:
            err = self._rt.cudaHostUnregister(self.address)
            if int(getattr(err, "value", err)) != 0:
                log.warning("cudaHostUnregister failed with CUDA error %s", err)
            self.pinned = False
        try:
            self._mmap.close()
        except BufferError:
            self._view = memoryview(self._mmap)[self.skip:self.skip + self.size]
            if was_pinned:
                self._pin(self._rt)
            raise
        self._mmap = None


_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def anon_huge_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` backed by transparent huge pages.

    Read from ``/proc/self/smaps`` (``AnonHugePages`` of every mapping that overlaps the
    range, clipped to it). Returns 0 where smaps is not readable.
    """
    end = address + nbytes
    total = 0
    try:
        with open("/proc/self/smaps") as fh:
            lo = hi = 0
            for line in fh:
                m = _SMAPS_HEADER.match(line)
                if m:
                    lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                elif line.startswith("AnonHugePages:") and lo < end and hi > address:
                    kib = int(line.split()[1])
                    overlap = min(hi, end) - max(lo, address)
                    total += min(kib * 1024, overlap)
    except OSError:
        return 0
    return total
