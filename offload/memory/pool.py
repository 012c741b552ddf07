"""``BufferPool``: aligned host buffers carved from a few huge-page regions and reused.

Allocation is the slow part of host memory (a fresh 4 GiB tensor fills at 1-5 GB/s because of
page faults, the second fill at 26 GB/s), so the pool maps large regions once, touches them
once, and hands out pieces of them again and again. Pieces are 4 KiB-aligned (O_DIRECT needs
offset, length and address on 4 KiB) and found best-fit in a per-region free list whose
neighbours merge on release, so a steady acquire/release pattern never grows the pool.

When CUDA is present every region is page-locked once with ``cudaHostRegister`` (what
``pin_memory=True`` does per tensor), so host<->device copies from pool buffers are
asynchronous; without CUDA nothing is pinned and no ``ulimit -l`` applies.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import threading
from typing import Any, Dict, List, Optional

from .accounting import Accounting, default_accounting
from .region import HUGE_PAGE, PAGE, Region, anon_huge_bytes, cuda_pin_available

__all__ = ["BufferPool", "HostBuffer"]

log = logging.getLogger(__name__)

_pool_ids = itertools.count()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _itemsize(dtype: Any) -> int:
    import torch

    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


class HostBuffer:
    """A piece of a pool region: ``nbytes`` at a 4 KiB-aligned address, until released.

    It holds no view itself (so closing the pool is refused only while *user* views live):
    ``memoryview``, ``tensor()`` and slicing create zero-copy views on demand.
    """

    __slots__ = ("_pool", "_region", "_offset", "nbytes", "capacity", "_released")

    def __init__(self, pool: "BufferPool", region: Region, offset: int, nbytes: int, capacity: int) -> None:
        self._pool = pool
        self._region = region
        self._offset = offset
        self.nbytes = nbytes
        """Bytes asked for."""
        self.capacity = capacity
        """Bytes reserved (``nbytes`` rounded up to the alignment); all of it is usable."""
        self._released = False

    def _check(self) -> None:
        if self._released:
            raise ValueError("HostBuffer was released to its pool; acquire a new one")

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (a multiple of 4096)."""
        self._check()
        return self._region.address + self._offset

    @property
    def pinned(self) -> bool:
        """Page-locked with ``cudaHostRegister`` (only ever true with CUDA present)."""
        return self._region.pinned

    @property
    def memoryview(self) -> memoryview:
        """A writable memoryview of the ``nbytes`` bytes (new view at each access)."""
        self._check()
        return self._region.view(self._offset, self.nbytes)

    def view(self, offset: int = 0, nbytes: Optional[int] = None) -> memoryview:
        """A writable memoryview of ``nbytes`` bytes from ``offset`` (bounds checked)."""
        self._check()
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view [{offset}, {offset}+{nbytes}) outside buffer of {self.nbytes} bytes")
        return self._region.view(self._offset + offset, nbytes)

    def __getitem__(self, key: slice) -> memoryview:
        """``buf[a:b]`` -> memoryview of those bytes (for ``IORequest.buf``)."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise ValueError(f"HostBuffer supports contiguous byte slices only, got {key!r}")
        start, stop, _ = key.indices(self.nbytes)
        return self.view(start, max(0, stop - start))

    def __len__(self) -> int:
        return self.nbytes

    def tensor(self, dtype: Any, numel: Optional[int] = None, offset_bytes: int = 0):
        """A 1-D torch tensor of ``dtype`` over the buffer, zero-copy (writes go to the buffer).

        ``numel`` None: as many elements as fit after ``offset_bytes``. ``offset_bytes`` must
        be a multiple of the element size so the tensor is naturally aligned.
        """
        import torch

        self._check()
        size = _itemsize(dtype)
        if offset_bytes < 0 or offset_bytes % size:
            raise ValueError(f"offset_bytes must be >= 0 and a multiple of {size} for {dtype}, got {offset_bytes}")
        avail = (self.nbytes - offset_bytes) // size if offset_bytes <= self.nbytes else -1
        if numel is None:
            numel = avail
        if numel < 0 or numel > avail:
            raise ValueError(f"{numel} x {dtype} at offset {offset_bytes} does not fit in {self.nbytes} bytes")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        mv = self._region.view(self._offset + offset_bytes, numel * size)
        # torch.frombuffer keeps a buffer export on the region until the tensor dies, which
        # is what makes BufferPool.close() refuse to unmap memory a tensor still uses.
        return torch.frombuffer(mv, dtype=dtype, count=numel)

    def __repr__(self) -> str:
        state = "released" if self._released else f"at 0x{self._region.address + self._offset:x}"
        return f"HostBuffer({self.nbytes} bytes {state}{', pinned' if self.pinned else ''})"


class BufferPool:
    """Aligned, reusable host buffers from 2 MiB-aligned huge-page regions.

    ``pin``: None pins (``cudaHostRegister``) only when CUDA is available; True requires CUDA
    (``RuntimeError`` without it); False never pins. ``region_bytes``: size of each new region
    (a larger request gets a region of its own size). ``max_bytes``: refuse (``MemoryError``)
    to map more than this in total. ``alignment``: of every buffer, a multiple of 4096.
    ``prefault``: touch regions when mapped so the first I/O does not page-fault.

    Thread-safe. ``close()`` unmaps everything; it raises ``BufferError`` and unmaps nothing
    of a region while tensors or memoryviews of it are alive (see ``region.py``).
    """

    def __init__(self, pin: Optional[bool] = None, *, region_bytes: int = 64 << 20,
                 max_bytes: Optional[int] = None, alignment: int = PAGE, huge: bool = True,
                 prefault: bool = True, accounting: Optional[Accounting] = None,
                 name: Optional[str] = None) -> None:
        # pin=None: pin when CUDA is there, and when the driver refuses (a sandboxed runtime,
        # pinnable memory exhausted) warn once and go on unpinned: copies from pageable
        # memory are correct, only synchronous. pin=True: a refusal raises.
        self._pin_optional = pin is None
        if pin is None:
            pin = cuda_pin_available()
        elif pin and not cuda_pin_available():
            raise RuntimeError("BufferPool(pin=True) needs CUDA (cudaHostRegister); torch sees no CUDA device. "
                               "Use pin=None to pin only when CUDA is present.")
        if region_bytes <= 0:
            raise ValueError(f"region_bytes must be > 0, got {region_bytes}")
        if alignment < PAGE or alignment % PAGE or alignment > HUGE_PAGE:
            raise ValueError(f"alignment must be a multiple of {PAGE} up to {HUGE_PAGE}, got {alignment}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.pin = bool(pin)
        self.region_bytes = _round_up(region_bytes, HUGE_PAGE)
        self.max_bytes = max_bytes
        self.alignment = alignment
        self._huge = huge
        self._prefault = prefault
        self._acct = accounting if accounting is not None else default_accounting()
        self.name = name or f"pool:{next(_pool_ids)}"
        self._lock = threading.Lock()
        self._regions: List[Region] = []
        # Per region: sorted free extents as two parallel lists (offsets, lengths).
        self._free_off: Dict[int, List[int]] = {}
        self._free_len: Dict[int, List[int]] = {}
        self._live: Dict[int, HostBuffer] = {}
        self._in_use = 0
        self._peak_in_use = 0
        self._acquires = 0
        self._reuses = 0
        self._closed = False

    # -- allocation -------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Map (and touch) regions now so that ``nbytes`` more can be acquired without mapping."""
        with self._lock:
            self._check_open()
            free = sum(sum(v) for v in self._free_len.values())
            if nbytes > free:
                self._new_region(nbytes - free)

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of ``nbytes`` (>= 1) at an ``alignment``-aligned address, reused when possible."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        cap = _round_up(nbytes, self.alignment)
        with self._lock:
            self._check_open()
            found = self._best_fit(cap)
            if found is None:
                region = self._new_region(cap)
                found = (id(region), 0)
            else:
                self._reuses += 1
            rid, off = found
            self._take(rid, off, cap)
            region = next(r for r in self._regions if id(r) == rid)
            buf = HostBuffer(self, region, off, nbytes, cap)
            self._live[id(buf)] = buf
            self._in_use += cap
            self._peak_in_use = max(self._peak_in_use, self._in_use)
            self._acquires += 1
            return buf

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back. Views of it must no longer be used (they are not revoked)."""
        with self._lock:
            if not isinstance(buf, HostBuffer) or self._live.get(id(buf)) is not buf:
                if isinstance(buf, HostBuffer) and buf._released:
                    raise ValueError("HostBuffer released twice")
                raise ValueError(f"{buf!r} does not belong to this pool")
            del self._live[id(buf)]
            buf._released = True
            self._in_use -= buf.capacity
            self._give(id(buf._region), buf._offset, buf.capacity)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"BufferPool {self.name} is closed")

    def _reserved(self) -> int:
        return sum(r.size for r in self._regions)

    def _new_region(self, nbytes: int) -> Region:
        size = max(self.region_bytes, _round_up(nbytes, HUGE_PAGE))
        if self.max_bytes is not None and self._reserved() + size > self.max_bytes:
            raise MemoryError(f"BufferPool {self.name}: mapping {size} more bytes would exceed "
                              f"max_bytes={self.max_bytes} ({self._reserved()} mapped, {self._in_use} in use)")
        try:
            region = Region(size, huge=self._huge, prefault=self._prefault, pin=self.pin)
        except RuntimeError as exc:
            if not (self.pin and self._pin_optional):
                raise
            log.warning("BufferPool %s: %s; its buffers stay unpinned (host-device copies are then synchronous)",
                        self.name, exc)
            self.pin = False
            region = Region(size, huge=self._huge, prefault=self._prefault, pin=False)
        self._regions.append(region)
        self._free_off[id(region)] = [0]
        self._free_len[id(region)] = [region.size]
        self._acct.add("pinned_host" if region.pinned else "pageable_host", self.name, region.size)
        return region

    def _best_fit(self, cap: int):
        best = None
        for region in self._regions:
            rid = id(region)
            for off, ln in zip(self._free_off[rid], self._free_len[rid]):
                if ln >= cap and (best is None or ln < best[0]):
                    best = (ln, rid, off)
                    if ln == cap:
                        return rid, off
        return None if best is None else (best[1], best[2])

    def _take(self, rid: int, off: int, cap: int) -> None:
        offs, lens = self._free_off[rid], self._free_len[rid]
        i = bisect.bisect_left(offs, off)
        ln = lens[i]
        if ln == cap:
            del offs[i], lens[i]
        else:
            offs[i] = off + cap
            lens[i] = ln - cap

    def _give(self, rid: int, off: int, cap: int) -> None:
        offs, lens = self._free_off[rid], self._free_len[rid]
        i = bisect.bisect_left(offs, off)
        offs.insert(i, off)
        lens.insert(i, cap)
        if i + 1 < len(offs) and offs[i] + lens[i] == offs[i + 1]:  # merge with the next
            lens[i] += lens.pop(i + 1)
            offs.pop(i + 1)
        if i > 0 and offs[i - 1] + lens[i - 1] == offs[i]:  # merge with the previous
            lens[i - 1] += lens.pop(i)
            offs.pop(i)

    # -- reporting and shutdown -------------------------------------------------------------

    def stats(self, huge_pages: bool = False) -> Dict[str, int]:
        """Byte counts for the memory report.

        ``reserved_bytes`` mapped in total = ``pinned_bytes`` + ``pageable_bytes``;
        ``in_use_bytes`` handed out now (capacity, i.e. rounded to the alignment), its peak;
        ``free_bytes``; ``buffers_in_use``; ``regions``; ``acquires`` and ``reuses`` (served
        without mapping). ``huge_pages=True`` adds ``huge_page_bytes`` read from
        /proc/self/smaps (slower: for tests and benchmarks).
        """
        with self._lock:
            reserved = self._reserved()
            pinned = sum(r.size for r in self._regions if r.pinned)
            out = {
                "regions": len(self._regions),
                "reserved_bytes": reserved,
                "pinned_bytes": pinned,
                "pageable_bytes": reserved - pinned,
                "in_use_bytes": self._in_use,
                "peak_in_use_bytes": self._peak_in_use,
                "free_bytes": reserved - self._in_use,
                "buffers_in_use": len(self._live),
                "acquires": self._acquires,
                "reuses": self._reuses,
            }
            if huge_pages:
                out["huge_page_bytes"] = sum(anon_huge_bytes(r.address, r.size) for r in self._regions if not r.closed)
            return out

    def close(self) -> None:
        """Unpin and unmap every region; buffers still acquired become unusable.

        Raises ``BufferError`` when views (tensors, memoryviews) of some regions are still
        alive: those regions stay mapped and usable, the others are unmapped, and a later
        ``close()`` retries. Idempotent once it succeeded.
        """
        with self._lock:
            if self._closed:
                return
            busy: List[Region] = []
            for region in self._regions:
                try:
                    region.close()
                except BufferError:
                    busy.append(region)
            # Recount from what is left (a closed region no longer says whether it was pinned).
            self._acct.clear_owner(self.name)
            for region in busy:
                self._acct.add("pinned_host" if region.pinned else "pageable_host", self.name, region.size)
            done = [r for r in self._regions if r.closed]
            for region in done:
                self._free_off.pop(id(region), None)
                self._free_len.pop(id(region), None)
            for key, buf in list(self._live.items()):
                if buf._region.closed:
                    buf._released = True
                    self._in_use -= buf.capacity
                    del self._live[key]
            self._regions = busy
            if busy:
                nbytes = sum(r.size for r in busy)
                raise BufferError(
                    f"BufferPool {self.name}: {len(busy)} region(s), {nbytes} bytes, still have live views "
                    f"(tensors from HostBuffer.tensor() or memoryviews); they stay mapped. Delete those views "
                    f"and call close() again.")
            self._closed = True

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit or with views alive: the OS reclaims it later
            pass

    def __repr__(self) -> str:
        return f"BufferPool({self.name}, {self._reserved()} bytes mapped, {self._in_use} in use, pin={self.pin})"
