"""``offload_params="nvme"``: a rank's param shards and their grads in a swap file, paged.

[Note: the param tier] Each shard (and its grad) is an *area*: a tensor over its own private
anonymous mapping, mirrored at a page-aligned offset of one file per rank
(``SWAP_DIR/offload-params.<pid>.rank<r>/areas.bin``; ``<pid>-<n>`` for the n-th after the first in
one process). Its pages are evicted (``MADV_DONTNEED``)
except while in use, so RAM holds only what is being gathered, reduced or stepped; who
touches the bytes says so through ``offload.memory.paging`` ([Note: paged tensors]). This
module is the pager: per page a state (on disk only, in memory and valid, being read),
reads and writes of whole pages through the io engines (O_DIRECT where the file system
allows), async reads for prefetch (``prefetch``; a later ``load`` of the same pages waits for
them). A page a view shares with its neighbour is read before it is partly overwritten, so
a write never loses the neighbour's bytes. A write that bypasses these calls (a torch optimizer
over the shards) is kept where sound, else refused by name ([Note: writes past the pager] in
tier_writes.py). A Ctrl-C is held until a call is done (offload/swap/sigint.py): a page and its
state change in two statements that a KeyboardInterrupt must not separate.

[Note: async stores] During a backward (``defer_stores``, set by the runtime's hooks)
``store`` submits its writes and returns; an ``evict`` of pages whose write is still in
flight is deferred (the pages are dropped once it completes), so a unit's grads go to disk
while the next unit computes. Elsewhere (the optimizer's step, whose stores its own pipeline
overlaps and whose RAM bound counts one sub-group's params: ``paged_bound``; checkpoint
loads) ``store`` returns once its bytes are on disk, as before. A later ``will_write`` or ``store`` of such
pages waits for the write first (the disk must not read bytes being overwritten, nor two
writes of one range race); a ``load`` needs not (the bytes in memory are the newest) and
cancels the deferred drop. At most ``write_window`` bytes are in flight (the oldest is waited
for beyond), which bounds the RAM held by deferred drops; ``flush`` waits for all of them
(the end of every backward, ``close``). A failed write raises from the next call that reaps
it, ``flush`` at the latest: the step after a backward never runs on grads that did not
reach the disk.
[Note: huge pages for areas] Areas of a huge page or more (params and grads) are advised for
transparent huge pages: a 56 MB shard read into dropped 4 KiB pages took 107 ms here (13,700
faults of ~2.5 us on this VM, in the thread that submits the read), into huge pages 33 ms; at
1B params those faults were ~2.4 s of a forward + backward (on NVMe 8.78 s against 5.27 s in
RAM with 4 KiB pages); the grads' writes alone, ~480k faults per 1B forward + backward on 4 KiB
pages, are ~25k on huge pages. The cost is RAM: a fault brings the whole huge page in, also the
part of it that is on disk, so ``evict`` drops the pages on disk beside its range up to the
huge pages' bounds (``_widen``, also for the drops deferred behind a write); pages a view
shares with its neighbour stay resident and may hold a whole huge page. The region past the
area's last page (up to 2 MiB - 4 KiB: regions are whole huge pages) is brought in by the same
fault and is on no disk page, so the last page's drop takes it too: it stayed resident, ~2 MB
per area, and was what the huge pages cost at the step's peak (ninth session, bench/RESULTS.md:
1B step peak 2.89 GB with every area on huge pages, 2.82 with the param areas only, 2.76 with
none). Tails dropped and the heap trimmed before the step ([Note: trimming the heap] in
offload/memory/heap.py): 2.51 GB with the param areas on huge pages, 2.52 with every area
(tenth session, helper D). The units' full buffers, wholly resident or wholly dropped, are on
huge pages too (flat_unit.py).
"""
from __future__ import annotations

import bisect
import errno
import itertools
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from offload.io import IORequest, open_engine
from offload.memory import HUGE_PAGE, PAGE, default_accounting, paging
from offload.memory.region import Region
from offload.shard.tier_dir import lock_dir, remove_orphans
from offload.shard.tier_writes import lost_write_error, written_on_disk
from offload.swap import fsutil
from offload.swap.sigint import removal_held, sigint_held

__all__ = ["ParamTier"]

log = logging.getLogger("offload.shard")

_ON_DISK, _VALID, _READING = 0, 1, 2
_SEQ = itertools.count()  # this process's tiers: a second model in one swap_dir gets a name of its own
_MAX_BUSY = 64  # names tried past those another process of our pid holds


class _Area:
    def __init__(self, region: Region, offset: int, nbytes: int, used: int) -> None:
        self.region, self.offset, self.nbytes, self.used = region, offset, nbytes, used  # used: the tensor's bytes
        self.start = region.address
        self.pages = -(-nbytes // PAGE)
        self.state = np.zeros(self.pages, dtype=np.int8)
        self.drop = np.zeros(self.pages, dtype=bool)  # evicted while its write flies: drop when done
        # [Note: writes past the pager] in tier_writes.py: the tensor, its version at the last
        # store, its name in errors, and whether a page on disk was found written and dropped
        self.tensor: Optional[torch.Tensor] = None
        self.version, self.name, self.lost = 0, "", False


class ParamTier:
    """The pager of one rank's paged shards and grads (see the note)."""

    write_window = 64 << 20
    """Bytes of writes in flight at most ([Note: async stores]). 64 MiB, not 128: at 2B params
    the forward + backward peaked 21 MB over the issue's RAM bound with 128 MiB (2.768 GB),
    and 2.726 GB with 64; the 1B fetch ratio moved within its run-to-run spread."""
    defer_stores = False
    """Whether ``store`` returns before its writes are done ([Note: async stores])."""

    def __init__(self, swap_dir: str, rank: int, *, io: Any = "auto") -> None:
        parent = fsutil.check_parent_dir(swap_dir)
        remove_orphans(parent)
        for _ in range(_MAX_BUSY):
            n = next(_SEQ)
            self.path = os.path.join(parent, f"offload-params.{os.getpid()}{f'-{n}' if n else ''}.rank{rank}")
            fsutil.make_private_dir(self.path)
            try:
                self._lock_fd = lock_dir(self.path)
                break
            except BlockingIOError:
                # held by a live process that has our pid in another pid namespace (two containers,
                # each its job's pid 1, on one host directory): its directory, not ours; the next name
                log.info("%s is in use by another process with this pid; taking the next name", self.path)
        else:
            raise fsutil.DirectoryBusy(errno.EWOULDBLOCK, f"the last {_MAX_BUSY} param swap directories named after "
                                       "this process are in use by other processes (their flock is held)",
                                       self.path, None)
        self._engine = None
        self._file = None
        try:
            self._engine = open_engine(io, directory=self.path)
            self._file = self._engine.open(os.path.join(self.path, "areas.bin"), write=True, create=True)
        except BaseException:
            self.close()
            raise
        self._areas: List[_Area] = []
        self._starts: List[int] = []
        self._by_start: List[_Area] = []
        self.logical: Dict[str, int] = {}  # "params" / "grads" -> bytes of the tensors (the file pads to pages)
        self._size = 0
        self._lock = threading.RLock()
        self._inflight: List[Tuple[_Area, List[Tuple[int, int]], Any]] = []
        self._writes: List[Tuple[_Area, int, int, Any]] = []  # (area, first page, end page, ticket)
        self._held: Set[int] = set()  # id() of the areas a live unit computes with (``hold``)
        self.bytes_read = self.bytes_written = 0
        self._owner = f"offload.shard params {self.path}"
        self._finalizer = weakref.finalize(self, ParamTier._cleanup, self._areas, self._engine, self._file,
                                           self.path, self._owner, os.getpid(), self._lock_fd)

    # ------------------------------------------------------------------ areas
    def area(self, numel: int, dtype: torch.dtype, kind: str = "params", name: str = "") -> torch.Tensor:
        """A new paged 1-D tensor of ``numel`` elements (zeros, on disk), with a file range;
        ``kind`` ("params" or "grads") for the report, ``name`` for errors."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        rounded = -(-max(nbytes, 1) // PAGE) * PAGE
        region = Region(rounded, huge=rounded >= HUGE_PAGE, prefault=False)  # [Note: huge pages for areas]
        a = _Area(region, self._size, rounded, nbytes)
        try:
            self._file.preallocate(self._size + rounded)  # ENOSPC now, not in a step
        except BaseException:
            region.close()
            raise
        self._size += rounded
        self.logical[kind] = self.logical.get(kind, 0) + nbytes
        self._areas.append(a)
        i = bisect.bisect(self._starts, a.start)
        self._starts.insert(i, a.start)
        self._by_start.insert(i, a)
        paging.register(a.start, rounded, self)
        default_accounting().add("nvme", self._owner, rounded)
        # state _ON_DISK: the file's fresh blocks read as zeros, as the untouched pages do
        t = torch.frombuffer(region.view(0, nbytes), dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
        a.tensor, a.version, a.name = t, t._version, name
        return t

    def _area_of(self, addr: int) -> _Area:
        i = bisect.bisect(self._starts, addr) - 1  # the areas sorted by address, as paging's registry
        if i >= 0:
            a = self._by_start[i]
            if addr < a.start + a.nbytes:
                return a
        raise ValueError(f"address {addr:#x} is not in a paged area of {self.path}")

    def _pages(self, addr: int, nbytes: int) -> Tuple[_Area, int, int, int, int]:
        """(area, first page, end page, offset, end offset) of a byte range."""
        a = self._area_of(addr)
        off = addr - a.start
        end = off + nbytes
        return a, off // PAGE, -(-end // PAGE), off, end

    # ------------------------------------------------------------------ I/O
    def _runs(self, a: _Area, p0: int, p1: int, want: int) -> List[Tuple[int, int]]:
        """The runs of pages in [p0, p1) whose state is ``want``."""
        return [(q0 + p0, q1 + p0) for q0, q1 in self._bool_runs(a.state[p0:p1] == want)]

    def _request(self, op: str, a: _Area, q0: int, q1: int) -> IORequest:
        return IORequest(op, self._file, a.offset + q0 * PAGE, a.region.view(q0 * PAGE, (q1 - q0) * PAGE))

    def _wait_reads(self, a: _Area, p0: int, p1: int) -> None:
        """Wait for the prefetches that touch pages [p0, p1) of ``a``."""
        keep = []
        for entry in self._inflight:
            b, runs, ticket = entry
            if b is a and any(q0 < p1 and p0 < q1 for q0, q1 in runs):
                self._check_read(b, runs, self._engine.wait(ticket))
                for q0, q1 in runs:  # only the pages this read brought in (not the gaps between)
                    b.state[q0:q1] = _VALID
            else:
                keep.append(entry)
        self._inflight = keep

    def _wait_writes(self, a: _Area, p0: int, p1: int) -> None:
        """Wait for the writes that touch pages [p0, p1) of ``a`` (and every older one: writes
        are reaped in order)."""
        last = -1
        for i, (b, q0, q1, _t) in enumerate(self._writes):
            if b is a and q0 < p1 and p0 < q1:
                last = i
        if last >= 0:
            self._reap(upto=last + 1)

    def _reap(self, upto: int = 0) -> None:
        """Retire the finished writes (waiting for the first ``upto``), then drop the pages
        whose eviction waited for them."""
        done: List[_Area] = []
        err: Optional[BaseException] = None
        while self._writes and (upto > 0 or self._engine.poll(self._writes[0][3])):
            a, q0, q1, ticket = self._writes.pop(0)
            upto -= 1
            try:
                self._check_written(a, q0, q1, self._engine.wait(ticket))
            except BaseException as exc:  # the others still retire (no buffer left in the kernel's hands)
                err = err or exc
            done.append(a)
        for a in {id(a): a for a in done}.values():
            busy = np.zeros(a.pages, dtype=bool)
            for b, q0, q1, _t in self._writes:
                if b is a:
                    busy[q0:q1] = True
            ready = a.drop & ~busy
            if ready.any():
                for q0, q1 in self._bool_runs(ready):
                    self._drop(*self._widen(a, q0, q1))  # as evict's own drops
        if err is not None:
            raise err

    @staticmethod
    def _bool_runs(mask: np.ndarray) -> List[Tuple[int, int]]:
        idx = np.nonzero(mask)[0]
        if idx.size == 0:
            return []
        breaks = np.nonzero(np.diff(idx) != 1)[0]
        starts = np.concatenate(([idx[0]], idx[breaks + 1]))
        ends = np.concatenate((idx[breaks], [idx[-1]])) + 1
        return list(zip(starts.tolist(), ends.tolist()))

    def _drop(self, a: _Area, q0: int, q1: int) -> None:
        # the last page's drop takes the region's tail too: a fault on the area's last huge
        # page brought it in, and nothing else ever drops it ([Note: huge pages for areas])
        if not a.lost and written_on_disk(a, q0, q1, a.state[q0:q1] == _ON_DISK):
            a.lost = True  # raised at the area's next call ([Note: writes past the pager])
        end = a.region.size if q1 >= a.pages else q1 * PAGE
        a.region._mmap.madvise(mmap.MADV_DONTNEED, a.region.skip + q0 * PAGE, end - q0 * PAGE)
        a.state[q0:q1] = _ON_DISK
        a.drop[q0:q1] = False

    def _writing(self, a: _Area, q0: int, q1: int) -> bool:
        return any(b is a and p0 < q1 and q0 < p1 for b, p0, p1, _t in self._writes)

    def flush(self) -> None:
        """Wait for every write in flight and drop the pages evicted meanwhile."""
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            self._reap(upto=len(self._writes))

    def _read(self, a: _Area, p0: int, p1: int) -> None:
        self._wait_reads(a, p0, p1)
        runs = self._runs(a, p0, p1, _ON_DISK)
        if not runs:
            return
        self._check_read(a, runs, self._engine.wait(self._engine.submit([self._request("read", a, q0, q1)
                                                                         for q0, q1 in runs])))
        for q0, q1 in runs:
            a.state[q0:q1] = _VALID
            self.bytes_read += (q1 - q0) * PAGE

    def _check_read(self, a: _Area, runs: List[Tuple[int, int]], done: List[int]) -> None:
        """The engines stop a read at end of file and report the bytes they got; every page here
        is inside the preallocated file, so fewer is an error (the file was truncated under us):
        the pages would keep the zeros MADV_DONTNEED left, read as the params or grads."""
        for (q0, q1), n in zip(runs, done):
            if n != (q1 - q0) * PAGE:
                raise OSError(errno.EIO, f"short read: {n} of {(q1 - q0) * PAGE} bytes at offset "
                              f"{a.offset + q0 * PAGE} (the file was truncated while in use?)",
                              os.path.join(self.path, "areas.bin"))

    def _check_written(self, a: _Area, q0: int, q1: int, done: List[int]) -> None:
        """The engines resubmit a short write and raise on an error, so fewer bytes than asked
        should not come back; if they do, the pages dropped after this write would read stale."""
        if list(done) != [(q1 - q0) * PAGE]:
            raise OSError(errno.EIO, f"short write: {sum(done)} of {(q1 - q0) * PAGE} bytes at offset "
                          f"{a.offset + q0 * PAGE}", os.path.join(self.path, "areas.bin"))

    # ------------------------------------------------------------------ the pager ([Note: paged tensors])
    def load(self, ranges: List[Tuple[int, int]]) -> None:
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            self._reap()
            for addr, n in ranges:
                a, p0, p1, _, _ = self._pages(addr, n)
                self._guard(a, p0, p1)
                a.drop[p0:p1] = False  # in memory still: used again, not dropped
                self._read(a, p0, p1)

    def prefetch(self, ranges: List[Tuple[int, int]]) -> None:
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            for addr, n in ranges:
                a, p0, p1, _, _ = self._pages(addr, n)
                self._guard(a, p0, p1)
                a.drop[p0:p1] = False  # wanted again: kept, not dropped and re-read
                runs = self._runs(a, p0, p1, _ON_DISK)
                if not runs:
                    continue
                ticket = self._engine.submit([self._request("read", a, q0, q1) for q0, q1 in runs])
                for q0, q1 in runs:
                    a.state[q0:q1] = _READING
                    self.bytes_read += (q1 - q0) * PAGE
                self._inflight.append((a, runs, ticket))

    def will_write(self, ranges: List[Tuple[int, int]]) -> None:
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            self._reap()
            for addr, n in ranges:
                a, p0, p1, off, end = self._pages(addr, n)
                self._guard(a, p0, p1)
                self._wait_reads(a, p0, p1)
                self._wait_writes(a, p0, p1)  # the disk must not read bytes being overwritten
                a.drop[p0:p1] = False
                if off % PAGE:
                    self._read(a, p0, p0 + 1)  # the neighbour's bytes on the first page
                if end % PAGE and end < a.used:
                    self._read(a, p1 - 1, p1)
                a.state[p0:p1] = _VALID

    def store(self, ranges: List[Tuple[int, int]]) -> None:
        """Submit the writes ([Note: async stores]); ``flush`` waits for them."""
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            self._reap()
            for addr, n in ranges:
                a, p0, p1, _, _ = self._pages(addr, n)
                self._wait_reads(a, p0, p1)
                self._wait_writes(a, p0, p1)  # two writes of one range must not race
                if (a.state[p0:p1] != _VALID).any():
                    raise RuntimeError(f"{self.path}: storing pages that are not in memory (a paged tensor "
                                       "written without will_write / load first)")
                a.drop[p0:p1] = False
                while self._writes and self._write_bytes() + (p1 - p0) * PAGE > self.write_window:
                    self._reap(upto=1)
                self._writes.append((a, p0, p1, self._engine.submit([self._request("write", a, p0, p1)])))
                self.bytes_written += (p1 - p0) * PAGE
                a.version = a.tensor._version  # its writer's bytes are stored ([Note: writes past the pager])
            if not self.defer_stores:
                self._reap(upto=len(self._writes))

    def check(self, ranges: List[Tuple[int, int]]) -> None:
        """``paging.check``: the guard of every call, alone ([Note: writes past the pager])."""
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            for addr, n in ranges:
                self._guard(*self._pages(addr, n)[:3])

    def _write_bytes(self) -> int:
        return sum((q1 - q0) * PAGE for _a, q0, q1, _t in self._writes)

    def hold(self, t: torch.Tensor, held: bool) -> None:
        """While ``held``, the area of ``t`` stays in memory whoever evicts it: a unit computes
        with it (flat_unit.py [Note: one rank's full buffer is its shard]); the optimizer or a
        checkpoint that loads and evicts the shard meanwhile must not drop its pages."""
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            a = self._area_of(t.data_ptr())
            if held:
                self._held.add(id(a))
            else:
                self._held.discard(id(a))

    def evict(self, ranges: List[Tuple[int, int]]) -> None:
        with sigint_held(False), self._lock:  # offload/swap/sigint.py
            lost = []
            for addr, n in ranges:
                a, p0, p1, off, end = self._pages(addr, n)
                self._guard(a, p0, p1)
                if id(a) in self._held:
                    continue
                q0, q1 = -(-off // PAGE), end // PAGE  # whole pages only: the edges may be a neighbour's
                if end >= a.used:
                    q1 = a.pages  # the rest of the last page is the area's own padding
                if q1 <= q0:
                    continue
                self._wait_reads(a, q0, q1)
                if self._writing(a, q0, q1):
                    a.drop[q0:q1] = True  # dropped once its write is done ([Note: async stores])
                else:
                    self._drop(*self._widen(a, q0, q1))
                if a.lost:
                    lost.append(a)
            self._reap()
            for a in lost:
                self._lost(a)

    # ------------------------------------------------------------------ writes past the pager
    def _moved(self, a: _Area) -> bool:
        return a.used > 0 and a.tensor._version != a.version

    def _guard(self, a: _Area, p0: int, p1: int) -> None:
        """Before a call on pages [p0, p1) of ``a``: a write that bypassed the pager is kept
        where sound, else refused by name ([Note: writes past the pager] in tier_writes.py)."""
        if self._moved(a):
            if (a.state == _VALID).all():  # it read the true values: stored as the pager's own
                self.store([(a.start, a.used)])
            else:
                self._lost(a)
        if a.lost or written_on_disk(a, p0, p1, a.state[p0:p1] == _ON_DISK):
            self._lost(a)

    def _lost(self, a: _Area) -> None:
        """Back to the values on disk (a held area keeps its valid pages: a unit computes with
        them), then the error that names the tensor."""
        self._wait_reads(a, 0, a.pages)
        self._wait_writes(a, 0, a.pages)
        runs = self._bool_runs(a.state == _ON_DISK) if id(a) in self._held else [(0, a.pages)]
        for q0, q1 in runs:
            self._drop(a, q0, q1)
        a.lost, a.version = False, a.tensor._version
        raise lost_write_error(a, self.path)

    @staticmethod
    def _widen(a: _Area, q0: int, q1: int) -> Tuple[_Area, int, int]:
        """[q0, q1) and the pages on disk beside it up to its huge pages' bounds: a fault in a
        huge-page area brings the whole huge page in, also the part on disk ([Note: huge
        pages for areas])."""
        per = HUGE_PAGE // PAGE
        lo, hi = (q0 // per) * per, min(a.pages, -(-q1 // per) * per)
        while q0 > lo and a.state[q0 - 1] == _ON_DISK:
            q0 -= 1
        while q1 < hi and a.state[q1] == _ON_DISK:
            q1 += 1
        return a, q0, q1

    # ------------------------------------------------------------------ reports
    def resident_bytes(self) -> int:
        return sum(int((a.state != _ON_DISK).sum()) * PAGE for a in self._areas)

    @property
    def disk_bytes(self) -> int:
        return self._size

    def close(self) -> None:
        if getattr(self, "_writes", None):
            try:
                self.flush()
            except OSError as exc:  # nothing in the file is read again: closing goes on
                log.warning("a write to %s failed while closing: %s", self.path, exc)
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            ParamTier._cleanup([], self._engine, self._file, self.path, None, os.getpid(),
                               getattr(self, "_lock_fd", None))

    @staticmethod
    def _cleanup(areas: List[_Area], engine: Any, file: Any, path: str, owner: Optional[str], pid: int,
                 lock_fd: Optional[int] = None) -> None:
        if os.getpid() != pid:
            return  # a forked child exiting: the directory is its parent's
        # a signal is delivered once the directory is gone and its lock closed (a Ctrl-C
        # between two unlinks left a half directory whose lock this process went on holding)
        with removal_held():
            ParamTier._release(areas, engine, file, path, owner, lock_fd)

    @staticmethod
    def _release(areas: List[_Area], engine: Any, file: Any, path: str, owner: Optional[str],
                 lock_fd: Optional[int]) -> None:
        for a in areas:
            paging.unregister(a.start)
        if owner is not None:
            default_accounting().clear_owner(owner)
        try:
            if file is not None:
                file.close()
            if engine is not None:
                engine.close()
        finally:
            try:
                fsutil.remove_private_dir(path)  # the lock file last
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s: %s", path, exc)
            if lock_fd is not None:
                os.close(lock_fd)
