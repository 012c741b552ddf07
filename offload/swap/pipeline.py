"""The swap pipeline: read sub-group g+1, compute g, write g-1, all at once.

[Note: pipeline] The caller's thread drives everything. For each sub-group it (1) makes sure
the reads of the next sub-groups are in flight (as many as free buffers allow; at least g+1),
(2) waits for the read of g, checks it, (3) calls ``compute(g, start, end, tensors)`` (the
kernel releases the GIL, so the engine's completions progress meanwhile), and (4) submits
the write of g into the other slot. A buffer goes back to the free list only when the engine
reports its write complete. With three buffers that is exactly read g+1 / compute g / write
g-1; more buffers read further ahead.

[Note: no read races a write] Within a step the reads of ``g`` come from its committed slot
and the writes go to the other one, so the same byte range is never read and written at
once; the step returns only after every write has completed and the files were
``fdatasync``-ed, so the next step's reads see the data. The pipeline also keeps the set of
(slot file, sub-group) ranges with a write in flight and refuses to submit a read of one
(a guard against engines that complete the wrong ticket; see TensorNVMe's read/write wait
mix-up).

[Note: durability] A write is complete when the engine says so: with O_DIRECT the data is in
the device (possibly in its volatile cache), buffered it is in the page cache. Either survives
a ``kill -9``; to also survive a power cut the step ends with ``fdatasync`` of the slot files
before the manifest flips (cheap with O_DIRECT: a cache flush, no data copy).
"""
from __future__ import annotations

import errno
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple, Union

import torch

from offload.swap.layout import ELEMS_PER_PAGE, SwapLayout, round_up

__all__ = ["SwapPipeline", "SwapStepError", "plan_sub_groups", "pipeline_host_bytes", "MIN_BUFFERS", "MAX_BUFFERS"]

log = logging.getLogger(__name__)

MIN_BUFFERS = 3          # read ahead, compute, write behind
MAX_BUFFERS = 8          # more read-ahead than this buys nothing measurable
DEFAULT_MAX_HOST_BYTES = 1 << 30
_TARGET_GROUPS = 16      # fill/drain of the pipeline costs ~2/G of the I/O time
_MIN_AUTO_GROUP = 1 << 18  # 1 MiB per fp32 state: keeps requests large

Compute = Callable[[int, int, int, List[torch.Tensor]], None]


# [Note: ranks vote before commit] With several data-parallel ranks, each rank's swap step
# covers only its shard, and the params are all-gathered after it: a rank whose step failed
# (disk full, EIO) and raised would leave the others waiting in that all-gather, and ranks
# that committed a step the failed rank did not would disagree from then on. So a
# multi-rank step is prepare / vote / commit: every rank writes its new states into the
# other slots and makes them durable (``store.sync``), then all ranks exchange one flag
# (``vote(ok) -> failed ranks``, a collective each rank calls exactly once per step, on
# success and on failure alike), and only if no rank failed does each commit its manifest.
# Otherwise every rank keeps the previous step (its manifest was never flipped), restores
# the params it already wrote, and raises, naming the ranks that failed. The manifest write
# itself can still fail on one rank after that vote - on a full disk it is the likeliest
# failure, as the slot files are preallocated and the manifest is a new file - so a second
# vote follows the commit: if a rank could not commit, the others undo theirs
# (``store.undo_commit``: the previous step's data is still in the other slots). Every rank
# votes the same number of times: once when the first vote fails, twice otherwise, and a
# rank with nothing to step does the same (``idle_votes``).
Vote = Callable[[bool], List[int]]


def vote_failed(vote: Vote, what: str) -> None:
    """Tell the other ranks that ``what`` failed here (a swap directory: its step); the local
    error stays the one raised."""
    try:
        vote(False)
    except Exception as exc:  # the process group itself is broken: nothing more to do here
        log.warning("could not tell the other ranks that %s failed: %s", what, exc)


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


def idle_votes(vote: Vote, step: Optional[int] = None, path: Optional[str] = None) -> None:
    """A rank with nothing to step takes part in both votes, and raises as the others do."""
    failed = vote(True)
    if not failed:
        failed = vote(True)
    if failed:
        raise peers_failed(failed, step, path, [])


def plan_sub_groups(numel: int, nstates: int, max_host_bytes: Optional[int],
                    sub_group_size: Optional[int]) -> Tuple[int, int]:
    """(sub_group_size, buffers) for ``numel`` elements of ``nstates`` fp32 states within
    ``max_host_bytes`` of pipeline buffers.

    A given ``sub_group_size`` is rounded up to whole 4 KiB pages of fp32 (1024 elements) so
    every transfer is O_DIRECT-aligned. Without one, sub-groups are sized for 4 buffers within
    the bound, and no larger than needed for ~16 sub-groups (a shorter pipeline fill/drain),
    but not under 256 Ki elements.
    """
    bound = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else int(max_host_bytes)
    if bound <= 0:
        raise ValueError(f"max_host_bytes must be > 0, got {max_host_bytes}")
    elems_all = round_up(numel, ELEMS_PER_PAGE)
    per_elem = nstates * 4
    if sub_group_size is not None:
        if sub_group_size <= 0:
            raise ValueError(f"sub_group_size must be > 0, got {sub_group_size}")
        sg = min(round_up(int(sub_group_size), ELEMS_PER_PAGE), elems_all)
    else:
        sg = (bound // (4 * per_elem)) // ELEMS_PER_PAGE * ELEMS_PER_PAGE
        sg = min(sg, max(round_up(-(-numel // _TARGET_GROUPS), ELEMS_PER_PAGE), _MIN_AUTO_GROUP), elems_all)
        if sg < ELEMS_PER_PAGE:
            sg = ELEMS_PER_PAGE  # let the check below explain why the bound is too small
    groups = -(-numel // sg)
    need = min(MIN_BUFFERS, groups)
    region = nstates * round_up(sg * 4, 4096)
    nbuf = min(bound // region, MAX_BUFFERS, groups)
    if nbuf < need:
        raise ValueError(
            f"max_host_bytes={bound} cannot hold {need} pipeline buffers of one sub-group "
            f"({sg} elements x {nstates} fp32 states = {region} bytes each, {need * region} in all); "
            f"raise max_host_bytes to at least {need * region} or lower sub_group_size")
    return sg, nbuf


def pipeline_host_bytes(buffers: int, region_bytes: int) -> int:
    """Host bytes a pipeline with its own pool maps for ``buffers`` buffers of
    ``region_bytes``: one region, rounded up to 2 MiB (huge pages) by the memory pool. This is
    what RSS sees and what ``memory_report()`` says; it can exceed ``max_host_bytes`` by less
    than 2 MiB."""
    return round_up(buffers * round_up(region_bytes, 4096), 2 << 20)


class _Interval:
    """Union of time intervals, to report how long some read (or write) was in flight."""

    def __init__(self) -> None:
        self.spans: List[Tuple[float, float]] = []

    def add(self, a: float, b: float) -> None:
        self.spans.append((a, b))

    def total(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


class SwapPipeline:
    """Stream sub-groups of a :class:`~offload.swap.store.SwapStore` through ``buffers``
    pool buffers (each one region) and call ``compute`` on each.

    ``pool``: an :class:`offload.memory.BufferPool` (one is made, and closed on
    :meth:`close`, when not given). Buffers are acquired once, here, and reused every step.
    """

    def __init__(self, store: Any, *, buffers: int, pool: Any = None) -> None:
        if buffers < min(MIN_BUFFERS, store.layout.num_groups):
            raise ValueError(f"the pipeline needs at least {MIN_BUFFERS} buffers, got {buffers}")
        self.store = store
        self.layout: SwapLayout = store.layout
        self._helpers: List[ThreadPoolExecutor] = []  # verify=True: read and write checksum threads
        self._owns_pool = pool is None
        if pool is None:
            from offload.memory import BufferPool

            # One region holding exactly our buffers (rounded to 2 MiB for huge pages): the
            # pool's default 64 MiB regions would map and prefault more than max_host_bytes.
            # Never pinned: these buffers only travel between the disk and the CPU kernel, so
            # page-locking them would cost locked memory (and `ulimit -l`) for no DMA.
            total = pipeline_host_bytes(buffers, self.layout.region_bytes)
            pool = BufferPool(pin=False, region_bytes=total, max_bytes=total, name=f"swap:{store.path}")
        self.pool = pool
        self.buffers: List[Any] = []
        self._registered = None  # (engine, handle) when the engine registered our buffers
        try:
            for _ in range(buffers):
                self.buffers.append(pool.acquire(self.layout.region_bytes))
            # Every swap transfer goes through these buffers for the store's life: let the
            # engine pin them once (uring's registered buffers) instead of per request. An
            # engine or kernel that cannot (or RLIMIT_MEMLOCK) returns None; nothing changes.
            register = getattr(store.engine, "register_buffers", None)  # duck-typed engines lack it
            handle = register(self.buffers) if register is not None else None
            if handle is not None:
                self._registered = (store.engine, handle)
        except BaseException:
            self.close()
            raise
        self.last_stats: Dict[str, float] = {}

    @property
    def host_bytes(self) -> int:
        """Host memory the pipeline holds: what its own pool mapped, else its buffers."""
        return sum(self.host_bytes_by_kind())

    @property
    def io_locked_bytes(self) -> int:
        """Bytes of our buffers the engine keeps page-locked (registered buffers): they
        count against RLIMIT_MEMLOCK and cannot be swapped out, pinned or not for CUDA."""
        return sum(b.capacity for b in self.buffers) if self._registered is not None else 0

    def host_bytes_by_kind(self) -> Tuple[int, int]:
        """(pinned, pageable) bytes held for the pipeline's buffers."""
        if self._owns_pool and self.buffers:
            st = self.pool.stats()
            return st["pinned_bytes"], st["pageable_bytes"]
        pinned = sum(b.capacity for b in self.buffers if b.pinned)
        return pinned, sum(b.capacity for b in self.buffers) - pinned

    def tensors(self, g: int, buf: Any) -> List[torch.Tensor]:
        """The fp32 state tensors of sub-group ``g`` inside ``buf`` (zero-copy views)."""
        s, e = self.layout.group_range(g)
        stride = self.layout.state_bytes(g)
        return [buf.tensor(torch.float32, e - s, k * stride) for k in range(self.layout.nstates)]

    def _zero(self, g: int, buf: Any) -> None:
        for t in self.tensors(g, buf):
            t.zero_()

    # ------------------------------------------------------------------ the step
    def run(self, groups: Iterable[int], compute: Compute, *,
            extra: Union[None, Dict[str, Any], Callable[[], Dict[str, Any]]] = None,
            commit: bool = True, vote: Optional[Vote] = None) -> Dict[str, float]:
        """Read, ``compute`` and write back each sub-group in ``groups`` (ascending), then
        commit the step to the store (unless ``commit=False``) with ``extra`` (a dict, or a
        callable evaluated once every write is done) as the manifest's opaque metadata.
        Returns per-phase timings in seconds: ``swap_read_s`` / ``swap_write_s`` (time during
        which some read / write was in flight, from submit to the moment the pipeline saw it
        complete), ``io_busy_s`` (the same for any I/O), ``kernel_s`` (inside ``compute``),
        ``wait_read_s`` / ``wait_write_s`` (this thread blocked on the engine),
        ``verify_s`` (checksums), ``commit_s`` (fdatasync + manifest), ``step_s``; and
        ``read_bytes``, ``write_bytes``, ``groups``. ``vote``: several ranks, see [Note: ranks
        vote before commit]; it is called exactly once, whatever happens."""
        store, engine = self.store, self.store.engine
        if store.closed:
            if vote is not None:
                vote_failed(vote, f"the swap step of {store.path}")
            raise RuntimeError(f"swap store {store.path} is closed")
        order = list(groups)
        verify = store.verify
        if verify and not self._helpers:
            # [Note: verify off the critical path] crc32 runs at ~2 GB/s per core (zlib releases
            # the GIL): checking reads and summing writes in the step's thread would add it to
            # every step; two helper threads overlap it with the kernel and the I/O instead.
            self._helpers = [ThreadPoolExecutor(1, thread_name_prefix=f"swap-verify-{k}") for k in ("read", "write")]
        t_step = time.perf_counter()
        free: List[Any] = list(self.buffers)
        reads: Dict[int, Tuple[Any, Any, float, List[Any]]] = {}   # index -> (buf, ticket, t0, reqs)
        writes: Deque[Tuple[int, Any, Any, float, List[Any]]] = deque()  # (g, buf, ticket, t0, reqs)
        in_flight_writes: set = set()
        read_span, write_span, io_span = _Interval(), _Interval(), _Interval()
        kernel_s = wait_read_s = wait_write_s = verify_s = 0.0
        read_bytes = write_bytes = 0
        written: Dict[int, Optional[List[List[int]]]] = {}
        computed: List[int] = []
        next_read = 0

        def finish_write(block: bool) -> bool:
            nonlocal wait_write_s, verify_s
            g, buf, ticket, t0, reqs = writes[0]
            if isinstance(ticket, Future):  # verify: checksum, then submit, on the write helper
                if not block and not ticket.done():
                    return False
                tw = time.perf_counter()
                ticket, written[g], vt = ticket.result()
                wait_write_s += time.perf_counter() - tw
                verify_s += vt
                writes[0] = (g, buf, ticket, t0, reqs)
            if not block and not engine.poll(ticket):
                return False
            tw = time.perf_counter()
            done = engine.wait(ticket)
            t1 = time.perf_counter()
            if block:
                wait_write_s += t1 - tw
            _check_counts(done, reqs, "write")
            write_span.add(t0, t1)
            io_span.add(t0, t1)
            writes.popleft()
            in_flight_writes.discard((1 - store.slots[g], g))
            free.append(buf)
            return True

        def submit_read(i: int) -> None:
            nonlocal read_bytes
            g = order[i]
            buf = free.pop()
            reqs = store.read_requests(g, buf)
            if not reqs:
                self._zero(g, buf)
                reads[i] = (buf, None, 0.0, reqs)
                return
            key = (store.slots[g], g)
            if key in in_flight_writes:  # see [Note: no read races a write]
                raise RuntimeError(f"internal error: read of sub-group {g} submitted while a write of it is in flight")
            read_bytes += sum(_nbytes(r.buf) for r in reqs)
            ticket = engine.submit(reqs)
            if verify:  # wait and check on the read helper, while this thread computes
                ticket = self._helpers[0].submit(self._wait_and_check, ticket, reqs, g, buf)
            reads[i] = (buf, ticket, time.perf_counter(), reqs)

        try:
            for i, g in enumerate(order):
                # (1) keep reads in flight: g itself and g+1 at least, more while buffers are free
                while next_read < len(order):
                    while writes and finish_write(block=False):
                        pass
                    if not free:
                        if next_read > i + 1:
                            break
                        finish_write(block=True)
                    submit_read(next_read)
                    next_read += 1
                # (2) wait for g's states
                buf, ticket, t0, reqs = reads.pop(i)
                if isinstance(ticket, Future):
                    tw = time.perf_counter()
                    t1, vt = ticket.result()
                    wait_read_s += time.perf_counter() - tw
                    verify_s += vt
                    read_span.add(t0, t1)
                    io_span.add(t0, t1)
                elif ticket is not None:
                    tw = time.perf_counter()
                    done = engine.wait(ticket)
                    t1 = time.perf_counter()
                    wait_read_s += t1 - tw
                    _check_counts(done, reqs, "read")
                    read_span.add(t0, t1)
                    io_span.add(t0, t1)
                # (3) compute
                s, e = self.layout.group_range(g)
                tk = time.perf_counter()
                compute(g, s, e, self.tensors(g, buf))
                kernel_s += time.perf_counter() - tk
                computed.append(g)
                written[g] = None
                # (4) write into the other slot (with verify: checksum first, on the write helper)
                wreqs = store.write_requests(g, buf)
                write_bytes += sum(_nbytes(r.buf) for r in wreqs)
                in_flight_writes.add((1 - store.slots[g], g))
                if verify:
                    wticket: Any = self._helpers[1].submit(self._checksum_and_submit, wreqs, g, buf)
                else:
                    wticket = engine.submit(wreqs)
                writes.append((g, buf, wticket, time.perf_counter(), wreqs))
            while writes:
                finish_write(block=True)
        except BaseException as exc:
            self._drain(reads, writes)
            if vote is not None:
                vote_failed(vote, f"the swap step of {store.path}")
            if isinstance(exc, OSError) and not isinstance(exc, SwapStepError):
                msg = (f"swap step {store.step + 1} aborted at sub-group {len(computed)} of {len(order)}: "
                       f"{exc.strerror or exc}; {store.held()}")
                raise SwapStepError(exc.errno or errno.EIO, msg, exc.filename or store.path, computed) from exc
            raise
        tc = time.perf_counter()
        if vote is not None:
            try:
                store.sync()
            except OSError as exc:
                vote_failed(vote, f"the swap step of {store.path}")
                msg = (f"swap step {store.step + 1} could not be made durable: {exc.strerror or exc}; "
                       f"the swap files still hold step {store.step}")
                raise SwapStepError(exc.errno or errno.EIO, msg, exc.filename or store.path, computed) from exc
            failed = vote(True)
            if failed:
                raise peers_failed(failed, store.step + 1, store.path, computed,
                                   f"the swap files still hold step {store.step}")
        if commit:
            try:
                store.commit(written, extra() if callable(extra) else extra, synced=vote is not None)
            except BaseException as exc:
                if vote is not None:
                    vote_failed(vote, f"the swap step of {store.path}")  # the second vote: the others undo theirs
                if not isinstance(exc, OSError):
                    raise
                msg = (f"swap step {store.step + 1} could not be committed: {exc.strerror or exc}; "
                       f"the swap files still hold step {store.step}")
                raise SwapStepError(exc.errno or errno.EIO, msg, exc.filename or store.path, computed) from exc
            if vote is not None:
                failed = vote(True)
                if failed:
                    step = store.step
                    try:
                        store.undo_commit()
                        held = f"this rank's commit was undone: the swap files still hold step {store.step}"
                    except OSError as exc:
                        held = (f"undoing this rank's commit failed too ({exc.strerror or exc}): its swap files "
                                f"hold step {step}, the other rank's the step before")
                    msg = (f"swap step {step} was applied on no rank: rank {', '.join(map(str, failed))} could not "
                           f"commit it; {held}")
                    raise SwapStepError(errno.ECANCELED, msg, store.path, computed)
        commit_s = time.perf_counter() - tc
        self.last_stats = {
            "swap_read_s": read_span.total(), "swap_write_s": write_span.total(), "io_busy_s": io_span.total(),
            "kernel_s": kernel_s,
            "wait_read_s": wait_read_s, "wait_write_s": wait_write_s, "verify_s": verify_s,
            "commit_s": commit_s, "step_s": time.perf_counter() - t_step,
            "read_bytes": float(read_bytes), "write_bytes": float(write_bytes), "groups": float(len(order)),
        }
        return self.last_stats

    def _wait_and_check(self, ticket: Any, reqs: List[Any], g: int, buf: Any) -> Tuple[float, float]:
        """Read helper: wait for the read of ``g``, check its counts and checksums."""
        _check_counts(self.store.engine.wait(ticket), reqs, "read")
        t1 = time.perf_counter()
        self.store.check(g, buf)
        return t1, time.perf_counter() - t1

    def _checksum_and_submit(self, wreqs: List[Any], g: int, buf: Any) -> Tuple[Any, List[List[int]], float]:
        """Write helper: checksum ``g``'s states, then submit their write."""
        t0 = time.perf_counter()
        sums = self.store.checksum(g, buf)
        vt = time.perf_counter() - t0
        return self.store.engine.submit(wreqs), sums, vt

    def _drain(self, reads: Dict[int, Tuple[Any, Any, float, List[Any]]], writes: Deque[Any]) -> None:
        """After a failure: wait for everything still in flight (errors ignored) so no engine
        or helper keeps using a buffer that the next step will reuse."""
        engine = self.store.engine
        pending = [t for _, t, _, _ in reads.values() if t is not None] + [w[2] for w in writes]
        for ticket in pending:
            try:
                if isinstance(ticket, Future):
                    res = ticket.result()
                    if isinstance(res, tuple) and len(res) == 3:  # a write: now wait for the I/O
                        engine.wait(res[0])
                else:
                    engine.wait(ticket)
            except Exception:  # already failing; the first error is the one reported
                pass
        reads.clear()
        writes.clear()

    def close(self) -> None:
        for ex in self._helpers:
            ex.shutdown(wait=True)
        self._helpers = []
        if self._registered is not None:  # before the memory can be unmapped
            engine, handle = self._registered
            self._registered = None
            engine.unregister_buffers(handle)
        for buf in self.buffers:
            self.pool.release(buf)
        self.buffers = []
        if self._owns_pool:
            try:
                self.pool.close()
            except BufferError:
                # a view of a buffer is still referenced (often from a traceback or a cycle);
                # collect and retry, else leave the memory mapped (it goes with the process)
                import gc

                gc.collect()
                try:
                    self.pool.close()
                except BufferError as exc:
                    log.warning("swap pipeline buffers stay mapped: %s", exc)


def _check_counts(done: List[int], reqs: List[Any], what: str) -> None:
    """The engine retries short transfers; a count that still falls short is an error."""
    if len(done) != len(reqs):
        raise OSError(errno.EIO, f"engine returned {len(done)} results for {len(reqs)} {what} requests",
                      reqs[0].file.path if reqs else None)
    for n, r in zip(done, reqs):
        if n != _nbytes(r.buf):
            raise OSError(errno.EIO, f"short {what}: {n} of {_nbytes(r.buf)} bytes at offset {r.offset}", r.file.path)


def _nbytes(buf: Any) -> int:
    return int(getattr(buf, "nbytes", None) or len(buf))
