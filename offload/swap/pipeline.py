"""The swap pipeline: read sub-group g+1, compute g, write g-1, all at once.

``SwapPipeline`` owns what lives from step to step: the host buffers (one store region
each, registered with the engine), the checksum helper threads, the typed views of a
buffer. Each step is a :class:`~offload.swap.step.StepSession` over those buffers ([Note:
pipeline] in session.py); ``run`` is its simplest client, with a compute callback.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from offload.kernels.fields import StateField, fields_bytes
from offload.kernels.quant import BLOCK, PACKED_BLOCK, zero_code
from offload.swap.agreement import Vote, vote_failed
from offload.swap import agreement
from offload.swap.layout import ALIGN, SwapLayout, as_fields, elems_per_page, round_up
from offload.swap.step import Extra, StepSession, SwapStepError, peers_failed

__all__ = ["SwapPipeline", "SwapStepError", "plan_sub_groups", "paged_bound", "unpaged_bound", "pipeline_host_bytes",
           "zero_state", "MIN_BUFFERS", "MAX_BUFFERS"]

log = logging.getLogger(__name__)

MIN_BUFFERS = 3          # read ahead, compute, write behind
MAX_BUFFERS = 8          # more read-ahead than this buys nothing measurable
DEFAULT_MAX_HOST_BYTES = 1 << 30
_TARGET_GROUPS = 16      # fill/drain of the pipeline costs ~2/G of the I/O time
_MIN_AUTO_GROUP = 1 << 18  # 1 MiB per fp32 state: keeps requests large

Compute = Callable[[int, int, int, List[torch.Tensor]], None]


# [Note: ranks vote before commit] is in agreement.py (the votes), [Note: pipeline] and [Note:
# no read races a write] in session.py (the streaming), [Note: durability] in step.py.


def idle_votes(vote: Optional[Vote], step: Optional[int] = None, path: Optional[str] = None) -> None:
    """A rank with nothing to step takes part in both votes, and raises as the others do."""
    agreement.idle_votes(vote, lambda failed: peers_failed(failed, step, path, []), "the swap step")


def paged_bound(max_host_bytes: Optional[int], nstates: Union[int, Sequence[Union[str, StateField]]],
                paged_bytes: int, sub_group_size: Optional[int]) -> Optional[int]:
    """The part of ``max_host_bytes`` left to the pipeline buffers when each element of the
    sub-group being computed also brings ``paged_bytes`` of paged memory into RAM (params on
    NVMe: its grad, the next sub-group's grad read ahead, its updated param), so that the
    buffers (4 per sub-group, as ``plan_sub_groups`` sizes them) and those pages together stay
    within the bound. Unchanged when a ``sub_group_size`` is given or nothing is paged. The
    forward + backward's free heap is not counted: the step gives it back first ([Note:
    trimming the heap] in offload/memory/heap.py)."""
    if not paged_bytes or sub_group_size is not None:
        return max_host_bytes
    bound = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else int(max_host_bytes)
    per = 4 * fields_bytes(as_fields(nstates), 1 << 18) / float(1 << 18)
    return max(1, int(bound * per / (per + paged_bytes))) if bound > 0 else bound  # 0: plan_sub_groups says


def unpaged_bound(buffer_bytes: int, nstates: Union[int, Sequence[Union[str, StateField]]], paged_bytes: int) -> int:
    """The least ``max_host_bytes`` whose ``paged_bound`` leaves ``buffer_bytes`` to the buffers."""
    per = 4 * fields_bytes(as_fields(nstates), 1 << 18) / float(1 << 18)
    b = int(buffer_bytes * (per + paged_bytes) / per)
    while int(b * per / (per + paged_bytes)) < buffer_bytes:
        b += 1
    return b


def plan_sub_groups(numel: int, nstates: Union[int, Sequence[Union[str, StateField]]],
                    max_host_bytes: Optional[int], sub_group_size: Optional[int]) -> Tuple[int, int]:
    """(sub_group_size, buffers) for ``numel`` elements of the states ``nstates`` (a count of
    fp32 states, or their names or typed fields) within ``max_host_bytes`` of pipeline buffers.

    A given ``sub_group_size`` is rounded up to a multiple of ``elems_per_page(fields)``
    (1024 elements of fp32, 262144 with a packed int8 field) so every transfer is
    O_DIRECT-aligned. Without one, sub-groups are sized for 4 buffers within the bound (the
    fields' bytes, packed blocks included: int8 states fit ~4x the elements of fp32), and no
    larger than needed for ~16 sub-groups (a shorter pipeline fill/drain), but not under 256
    Ki elements.
    """
    fields = as_fields(nstates)
    bound = DEFAULT_MAX_HOST_BYTES if max_host_bytes is None else int(max_host_bytes)
    if bound <= 0:
        raise ValueError(f"max_host_bytes must be > 0, got {max_host_bytes}")
    page = elems_per_page(fields)
    elems_all = round_up(numel, page)
    if sub_group_size is not None:
        if sub_group_size <= 0:
            raise ValueError(f"sub_group_size must be > 0, got {sub_group_size}")
        sg = min(round_up(int(sub_group_size), page), elems_all)
    else:
        sg = (bound // (4 * fields_bytes(fields, page))) * page  # packed blocks counted by their bytes
        sg = min(sg, max(round_up(-(-numel // _TARGET_GROUPS), page), _MIN_AUTO_GROUP), elems_all)
        if sg < page:
            sg = page  # let the check below explain why the bound is too small
    groups = -(-numel // sg)
    need = min(MIN_BUFFERS, groups)
    region = sum(round_up(f.nbytes(sg), ALIGN) for f in fields)
    nbuf = min(bound // region, MAX_BUFFERS, groups)
    if nbuf < need:
        kinds = "/".join(sorted({f.dtype_name for f in fields}))
        err = ValueError(
            f"max_host_bytes={bound} cannot hold {need} pipeline buffers of one sub-group "
            f"({sg} elements x {len(fields)} {kinds} states = {region} bytes each, {need * region} in all); "
            f"raise max_host_bytes to at least {need * region}{_smaller_sub_group_advice(sg, page)}")
        err.buffer_bytes = need * region  # what the buffers need: a caller that shrank the bound restates it
        raise err
    return sg, nbuf


def _smaller_sub_group_advice(sg: int, page: int) -> str:
    """Suggest a smaller sub_group_size only where there is one: a value under ``page`` is
    rounded up to it (262144 elements with int8 states, so that advice failed the same way)."""
    if sg > page:
        return " or lower sub_group_size"
    return (f" (sub_group_size is already the smallest, {page} elements: a smaller one is rounded up "
            f"to keep transfers O_DIRECT-aligned)")


def zero_state(field: StateField, t: torch.Tensor) -> None:
    """``t`` (``field``'s storage) holds zeros: packed blocks of the zero code with absmax 0,
    as encoding zeros gives (all-zero bytes would be code 0, which decodes to -0.0)."""
    if not field.blocked:
        t.zero_()
        return
    blocks = t.view(-1, PACKED_BLOCK)
    blocks[:, :BLOCK] = zero_code(field.signed)
    blocks[:, BLOCK:] = 0


def pipeline_host_bytes(buffers: int, region_bytes: int) -> int:
    """Host bytes a pipeline with its own pool maps for ``buffers`` buffers of
    ``region_bytes``: one region, rounded up to 2 MiB (huge pages) by the memory pool. This is
    what RSS sees and what ``memory_report()`` says; it can exceed ``max_host_bytes`` by less
    than 2 MiB."""
    return round_up(buffers * round_up(region_bytes, 4096), 2 << 20)


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
        """The state tensors of sub-group ``g`` inside ``buf`` (zero-copy views, each of its
        field's storage dtype: the packed uint8 blocks of a blocked field)."""
        s, e = self.layout.group_range(g)
        return [buf.tensor(f.storage_dtype, f.storage_numel(e - s), off)
                for f, (off, _, _) in zip(self.layout.fields, self.layout.state_spans(g))]

    def zero(self, g: int, buf: Any) -> None:
        """Fill ``g``'s states in ``buf`` with zeros (a sub-group never written)."""
        for f, t in zip(self.layout.fields, self.tensors(g, buf)):
            zero_state(f, t)

    def verify_helpers(self) -> Tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """(read, write) helper threads for checksums, made at the first verified step.

        [Note: verify off the critical path] crc32 runs in the step's thread at about the
        rate of one core (zlib releases the GIL): checking reads and summing writes there
        would add it to every step; two helper threads overlap it with the kernel and the
        I/O instead (the rate measured is in bench/RESULTS.md)."""
        if not self._helpers:
            self._helpers = [ThreadPoolExecutor(1, thread_name_prefix=f"swap-verify-{k}") for k in ("read", "write")]
        return self._helpers[0], self._helpers[1]

    # ------------------------------------------------------------------ the step
    def open_session(self, groups: Iterable[int], *, vote: Optional[Vote] = None) -> StepSession:
        """A step over ``groups`` (ascending) as a session: ``views(g)`` / ``finish(g)`` for
        each inside ``guard()``, then ``drain()`` and ``commit()`` (see step.py). ``vote``:
        several ranks, see [Note: ranks vote before commit] in agreement.py."""
        if self.store.closed:
            vote_failed(vote, f"the swap step of {self.store.path}")
            raise RuntimeError(f"swap store {self.store.path} is closed")
        return StepSession(self, list(groups), vote)

    def run(self, groups: Iterable[int], compute: Compute, *, extra: Extra = None,
            commit: bool = True, vote: Optional[Vote] = None) -> Dict[str, float]:
        """Read, ``compute(g, start, end, tensors)`` and write back each sub-group in
        ``groups`` (ascending), then commit the step to the store (unless ``commit=False``)
        with ``extra`` (a dict, or a callable evaluated once every write is done) as the
        manifest's opaque metadata. Returns per-phase timings in seconds: ``swap_read_s`` /
        ``swap_write_s`` (time during which some read / write was in flight, from submit to
        the moment the pipeline saw it complete), ``io_busy_s`` (the same for any I/O),
        ``kernel_s`` (inside ``compute``), ``wait_read_s`` / ``wait_write_s`` (this thread
        blocked on the engine), ``verify_s`` (checksums), ``commit_s`` (fdatasync +
        manifest), ``step_s``; and ``read_bytes``, ``write_bytes``, ``groups``. ``vote``:
        several ranks, see [Note: ranks vote before commit] in agreement.py; every rank
        votes as often as the others, whatever happens."""
        with self.store.in_flight.held():  # a close() in another thread waits ([Note: a close meets a step])
            session = self.open_session(groups, vote=vote)
            with session.guard():
                for g in session.groups:
                    s, e = self.layout.group_range(g)
                    compute(g, s, e, session.views(g))
                    session.finish(g)
                session.drain()
            self.last_stats = session.commit(extra, commit=commit)
        return self.last_stats

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
                except BufferError:
                    # Nothing for the user to do (the pool's own text says to call close()
                    # again): the regions go with the views' last reference, a failed
                    # constructor's traceback, say, and with the process at the latest.
                    log.info("swap pipeline buffers stay mapped until the views of them still alive go")
