"""The swapped store: optimizer states in NVMe swap files (``offload="nvme"``), described by
typed fields (``offload/kernels/fields.py``).

It is the one swapped store ([Note: one swapped store] in swapped_state.py): the flat store
swaps its shards' ``SHARD_FIELDS`` (fp32 master, exp_avg, exp_avg_sq) through it, and the
in-place store of fp32 CPU params (``SwappedState``) is its one-shard case with
``IN_PLACE_FIELDS`` (the moments only; each work item's output, mode ``"master"``, is the
param itself, its own master).

The flat store (``flat/store.py``) keeps, per flat group, this rank's shard of a flat fp32 master and two
moments. With ``offload="nvme"`` all three go to one swap store: its element space is the shards of the
groups laid end to end (group ``k`` at ``base[k]``), the same order as a rank's checkpoint files
(``offload/zero/checkpoint.py``), so a checkpoint is the store streamed out as it is. Host memory holds only
the pipeline buffers (bounded by ``max_host_bytes``) plus what the params need anyway (grads, the low-
precision copy on its way out).

[Note: outputs] The master is ours, not the user's: after the kernel updates a sub-group of it, the new
values must reach the param. Each work item names an ``out`` tensor and how to fill it: ``"lowp"``, the
kernel writes the fp16/bf16 copy (RNE) in the same pass (the param itself, a staging buffer, or the shard
that is all-gathered); ``"copy"``, the fp32 master is copied out after the kernel (fp32 device params, fp32
params of a partitioned group). The swap files therefore always hold the truth: after a failed step the
outputs of the sub-groups already computed are rewritten from the previous step's master (no partial step is
left in the params), and ``resume=True`` rewrites the params from the master of the last finished step.
"""
from __future__ import annotations

import os
import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import ADAM, MASTER, Rule, StateField, field_names
from offload.kernels.quant import BLOCK
from offload.optim.swapped_ranges import (DecodedBlocks, compressed, paged_copy, read_dtype, read_values, rounding_kwargs,
                                          storage_slice, whole_blocks, write_values)
from offload.optim.stats import swap_phases
from offload.optim.swapped_compute import make_compute
from offload.optim.step_guard import mark_consistent
from offload.swap import SwapPipeline, SwapStepError, SwapStore
from offload.swap.pipeline import Vote, idle_votes, vote_failed
from offload.swap.cache import GroupCache, serialized
from offload.swap.manifest_check import check_identity
from offload.swap.runs import make_identity, open_store
from offload.zero.checkpoint import IN_PLACE_FIELDS, SHARD_FIELDS

__all__ = ["SwappedShards", "WorkItem", "Output", "SHARD_FIELDS", "IN_PLACE_FIELDS"]


class WorkItem(NamedTuple):
    """One range of a shard to step: the one work item of every store's step (the flat
    store's loop in ``flat/steps.py`` and the swapped stores); positional tuples of this
    order are accepted too."""

    shard: int
    lo: int
    hi: int
    grad: torch.Tensor
    """1-D, ``hi - lo`` elements."""
    kwargs: Dict[str, Any]
    """The kernel's hyperparameters for this range (``AdamHyper.kernel_kwargs(step)``)."""
    out: Optional[torch.Tensor]
    mode: str
    """Where the updated values go ([Note: outputs]): ``"lowp"`` (the kernel writes ``out``,
    fp16/bf16), ``"copy"`` (the master is copied into ``out`` after the kernel) or
    ``"master"`` (``out`` IS the fp32 master: an fp32 CPU param updated in place, in a store
    whose fields have no MASTER)."""
    then: Optional[Callable[[], None]] = None
    """The flat store's param sink's work once the range is computed (left to the caller)."""
    rule: Optional[Rule] = None
    """The float32 rule this range steps with, when it is not the store's (a param group of
    plain Adam in a store of adam_amsgrad): the store's rule holds its fields, and the
    kernel steps those only (``Rule.narrowed``). None: the store's rule."""


class Output(NamedTuple):
    """Where the master of a range goes (``emit_all``)."""

    shard: int
    lo: int
    hi: int
    out: torch.Tensor
    mode: str


def close_quietly(pipeline: SwapPipeline, store: SwapStore, remove: bool = True) -> None:
    """Close (also from the garbage collector): buffers first, then files and directory
    (``remove=False``: kept). Nothing in a forked child: the buffers' io_uring registration
    is the parent's too."""
    if getattr(store, "owner_pid", None) not in (None, os.getpid()):
        store.close()  # marks it closed; touches nothing
        return
    store.in_flight.wait_others(store.path)  # before the buffers go ([Note: a close meets a step] in swap/in_flight.py)
    try:
        pipeline.close()
    finally:
        store.close(remove=remove)


class SwappedShards:
    """The swapped store: the ``fields`` of shards of sizes ``sizes`` in one swap store.

    ``fields``: what is kept per element (``SHARD_FIELDS``: fp32 master + moments, the flat
    store; ``IN_PLACE_FIELDS``: moments only, for fp32 CPU params that are their own master,
    ``SwappedState``). ``identity``: JSON facts that must match on resume (the flat groups'
    numels, world, rank; recorded with every commit). ``extra``: called at each commit, JSON
    to store with the step (the per-param step counts). ``resume``: reopen the directory of
    an earlier run (see the module note); ``check_resume(extra, store)`` replaces the check that the
    manifest holds ``identity`` (manifest_check.check_identity): run on each directory of the
    identity opened, it returns whether a fingerprint recognised the params and raises
    swap.runs.ParamsMismatch for other values ([Note: same identity] in swap/runs.py).
    ``summary``: how messages name the params."""

    kind = "nvme"

    def __init__(self, sizes: Sequence[int], *, swap_dir: str, identity: Dict[str, Any],
                 extra: Callable[[], Dict[str, Any]], max_host_bytes: Optional[int] = None,
                 sub_group_size: Optional[int] = None, verify: bool = False, resume: Any = False,
                 io_engine: Any = None, backend: Optional[str] = None, num_threads: Optional[int] = None,
                 rank: int = 0, run_name: str = "flat", vote: Optional[Vote] = None,
                 fields: Sequence[StateField] = SHARD_FIELDS, summary: Optional[str] = None,
                 check_resume: Optional[Callable[[Dict[str, Any], SwapStore], Optional[bool]]] = None, pool: Any = None,
                 rule: Rule = ADAM, stochastic_states: bool = False, padded_ends: bool = False) -> None:
        """``padded_ends``: each item is followed by padding up to a block (the flat store's
        params): fused kernel, no decoding ([Note: steps across blocks], swapped_ranges.py)."""
        from offload.kernels import get_backend

        self._kernel = get_backend(backend)
        self._threads = num_threads
        self._vote = vote  # several ranks: see [Note: ranks vote before commit] in swap/pipeline.py
        self.fields = tuple(fields)
        self.names = field_names(self.fields)
        self.has_master = MASTER in self.fields
        # the kernel rule every range steps: its states are ``fields`` without the master
        if tuple(f for f in self.fields if f != MASTER) != rule.fields:
            raise ValueError(f"fields {self.names} do not hold rule {rule.name!r}'s states {rule.names}")
        self.rule = rule
        self.stochastic_states = bool(stochastic_states)
        self.padded_ends = bool(padded_ends)
        # a step rounds (passes a seed and an offset) with compressed states or a bf16 param
        self.rounds = any(compressed(f) for f in rule.fields)
        self.sizes = [int(n) for n in sizes]
        self.base: List[int] = []
        # [Note: blocks in the swap space] packed int8 fields are cut at block boundaries only:
        # each shard starts on one (its last block padded), so every range a kernel steps,
        # from a shard's start, covers whole blocks. fp32/bf16 layouts stay end to end.
        unit = BLOCK if any(f.blocked for f in self.fields) else 1
        total = 0
        for n in self.sizes:
            total = -(-total // unit) * unit
            self.base.append(total)
            total += n
        if total == 0:
            raise ValueError("SwappedShards needs at least one element")
        self.numel = total
        self.identity = dict(identity)
        self._extra_fn = extra
        self.meta_dirty: Optional[bool] = None  # None: flush() compares the metadata with the manifest's
        self.computed: List[int] = []  # the sub-groups whose kernel ran in the last step, in order
        self.pipeline: Optional[SwapPipeline] = None
        summary = summary or f"{total} elements in {len(self.sizes)} flat groups of rank {rank}"
        check = check_resume or (lambda extra, store, want=self.identity: check_identity(want, extra, store.path))
        self.store, nbuf = open_store(swap_dir, total, self.fields, identity=make_identity(self.identity, summary),
                                      max_host_bytes=max_host_bytes, sub_group_size=sub_group_size,
                                      run_name=run_name, rank=rank, verify=verify, resume=resume, io_engine=io_engine,
                                      check=lambda store: check(store.extra, store))  # [Note: same identity]
        self.layout = self.store.layout  # on resume: the manifest's sub_group_size ([Note: layout on resume])
        self.resumed = resume = self.store.resumed  # resume="auto" decided ([Note: restarts] in swap/runs.py)
        try:
            self.pipeline = SwapPipeline(self.store, buffers=nbuf, pool=pool)
            self._cache = GroupCache(self.pipeline)
        except BaseException:
            if self.pipeline is not None:
                self.pipeline.close()
            self.store.close(remove=not resume)  # a directory we were asked to resume stays
            raise
        self.last_stats: Dict[str, float] = {}
        self._finalizer = weakref.finalize(self, close_quietly, self.pipeline, self.store)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def swap_path(self) -> str:
        return self.store.path

    @property
    def resumed_extra(self) -> Dict[str, Any]:
        """The manifest's metadata of the last committed step (the per-param steps)."""
        return dict(self.store.extra)

    def _meta(self) -> Dict[str, Any]:
        """What a commit records with the data: ``extra()`` and the identity. Called for a
        commit (or a comparison): with ``meta_dirty`` tracked, what it returns is committed."""
        if self.meta_dirty:
            self.meta_dirty = False
        return dict(self._extra_fn(), **self.identity)

    def _field(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown state {name!r}; expected one of {self.names}") from None

    def _spans(self, k: int, lo: int, hi: int):
        """(sub-group g, its [s, e), the overlap [a, b)) in swap space for shard ``k``'s [lo, hi)."""
        if not 0 <= lo <= hi <= self.sizes[k]:
            raise ValueError(f"range [{lo}, {hi}) outside shard {k} of {self.sizes[k]} elements")
        a0, b0 = self.base[k] + lo, self.base[k] + hi
        for g in self.layout.groups_overlapping(a0, b0):
            s, e = self.layout.group_range(g)
            yield g, s, e, max(s, a0), min(e, b0)

    # ------------------------------------------------------------------ whole store
    def initialise(self, outputs_source: Callable[[int, int, int, torch.Tensor], None]) -> None:
        """Write step 0: master from ``outputs_source(k, lo, hi, out)`` (fills ``out`` with the
        fp32 values of shard ``k``'s [lo, hi)), zero moments; one streamed pass, one commit.
        Without a MASTER field (params updated in place) the moments are zeros already: only
        the metadata is committed."""
        from offload.swap.checkpoint import stream_groups

        if not self.has_master:
            self.store.commit({}, self._meta(), advance=False)
            return
        written: Dict[int, Any] = {}
        j = self._field(MASTER.name)

        def process(g: int, buf: Any) -> None:
            s, e = self.layout.group_range(g)
            tensors = self.pipeline.tensors(g, buf)
            for t in tensors:
                t.zero_()
            master = tensors[j]
            for k in range(len(self.sizes)):
                a, b = max(s, self.base[k]), min(e, self.base[k] + self.sizes[k])
                if a < b:
                    outputs_source(k, a - self.base[k], b - self.base[k], master[a - s:b - s])
            written[g] = self.store.checksum(g, buf) if self.store.verify else None

        self._cache.invalidate()
        stream_groups(self.store.engine, self.pipeline.buffers, list(range(self.layout.num_groups)),
                lambda g, buf: [], process, self.store.write_requests)
        self.store.commit(written, self._meta(), advance=False)

    @serialized
    def emit_all(self, outputs: Sequence[Output]) -> None:
        """Write the committed master of each output range into its ``out`` (resume, and the
        params after a failed step). Needs a MASTER field."""
        j = self._field(MASTER.name)
        by_group: Dict[int, List[Tuple[int, int, int, torch.Tensor, int]]] = {}
        for k, lo, hi, out, _ in outputs:
            for g, s, e, a, b in self._spans(k, lo, hi):
                by_group.setdefault(g, []).append((s, a, b, out, self.base[k] + lo))
        for g in sorted(by_group):
            master = self._cache.load(g, self._meta)[j]
            for s, a, b, out, start in by_group[g]:
                # either mode: the master rounded to out's dtype (RNE, as the kernel's own copy)
                paged_copy(out[a - start:b - start], master[a - s:b - s])

    # ------------------------------------------------------------------ ranges
    @serialized
    def read(self, k: int, lo: int, hi: int, names: Optional[Sequence[str]] = None,
             stored: bool = False) -> Dict[str, torch.Tensor]:
        """New tensors with the committed ``names`` (default: every field) of shard ``k``'s
        [lo, hi): of each field's dtype, float32 (decoded) for a compressed field; ``stored``:
        a bf16 field as bf16 (packed blocks are decoded either way: swapped_ranges.read_values)."""
        names = self.names if names is None else tuple(names)
        idx = [self._field(n) for n in names]
        out = {n: torch.empty(hi - lo, dtype=read_dtype(self.fields[j], stored)) for n, j in zip(names, idx)}
        start = self.base[k] + lo
        for g, s, e, a, b in self._spans(k, lo, hi):
            tensors = self._cache.load(g, self._meta)
            for n, j in zip(names, idx):
                out[n][a - start:b - start].copy_(read_values(self.fields[j], tensors[j], a - s, b - s, e - s, stored))
        return out

    @serialized
    def read_storage(self, k: int, lo: int, hi: int, name: str) -> torch.Tensor:
        """A new 1-D tensor with the committed storage of ``name`` for shard ``k``'s [lo, hi):
        the stored values, or the packed blocks of a blocked field (``lo`` on a block of its
        sub-group: SwappedState's params start on one), as opt.state[p] shows them."""
        j = self._field(name)
        parts = [storage_slice(self.fields[j], self._cache.load(g, self._meta)[j], a - s, b - s).clone()
                 for g, s, e, a, b in self._spans(k, lo, hi)]  # (copied: the next load reuses the buffer)
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.fields[j].storage_dtype)

    @serialized
    def write(self, k: int, lo: int, hi: int, values: Dict[str, torch.Tensor]) -> None:
        """Set ``values`` (state name -> hi - lo elements; float32 values of a compressed field
        are encoded, see swapped_ranges.py) of shard ``k``'s [lo, hi); kept in the
        cache until :meth:`flush` (or the next step, or another sub-group) commits them."""
        idx = {n: self._field(n) for n in values}
        for n, t in values.items():
            if t.numel() != hi - lo:
                raise ValueError(f"{n}: {t.numel()} elements for a range of {hi - lo}")
        start = self.base[k] + lo
        for g, s, e, a, b in self._spans(k, lo, hi):
            tensors = self._cache.load(g, self._meta)
            for n, t in values.items():
                write_values(self.fields[idx[n]], tensors[idx[n]], a - s, b - s, e - s,
                             t.detach().reshape(-1)[a - start:b - start])
            self._cache.mark_dirty()

    @contextlib.contextmanager
    def atomic_writes(self) -> Iterator[None]:
        """The write()s inside go to the free slots and are committed once at the end, with
        the metadata of that moment: a kill or an error at any point leaves every state as
        before (a whole load_state_dict)."""
        with self._cache.lock:  # (serialized: held by the block's writes too)
            self.flush()
            self._cache.begin_batch()
            try:
                yield
                self._cache.commit_batch(self._meta())
            except BaseException:
                self._cache.abort_batch()
                raise

    @serialized
    def flush(self) -> None:
        """Commit pending writes, and the metadata when it changed (steps after a load):
        compared with the manifest's, or, with ``meta_dirty`` tracked, when it is set."""
        if not self._cache.flush(self._meta):
            if self.meta_dirty is None:
                meta = self._meta()
                if meta != self.store.extra:
                    self.store.commit({}, meta, advance=False)
            elif self.meta_dirty:
                self.store.commit({}, self._meta(), advance=False)

    # ------------------------------------------------------------------ the step
    @serialized
    def step(self, items: Sequence[WorkItem]) -> Dict[str, float]:
        """One Adam step over ``items`` (see ``WorkItem``), streamed read g+1 / compute g /
        write g-1; the outputs are filled per sub-group. On an I/O failure the swap files
        stay at the previous step, the outputs already filled are rewritten from it, and a
        ``SwapStepError`` says so. With several ranks (``vote``) every rank must call this every
        step, with or without items, and all of them apply the step or none does."""
        vote = self._vote
        if not items:
            if vote is not None:
                idle_votes(vote, self.store.step + 1, self.store.path)
            return {}
        voted = False

        def vote_once(ok: bool) -> List[int]:
            nonlocal voted
            voted = True
            return vote(ok)

        try:
            return self._step(items, vote_once if vote is not None else None)
        except BaseException:
            if vote is not None and not voted:  # failed before the pipeline could vote
                vote_failed(vote, f"the swap step of {self.store.path}")
            raise

    def _step(self, items: Sequence[WorkItem], vote: Optional[Vote]) -> Dict[str, float]:
        self._cache.flush(self._meta)
        self._cache.invalidate()  # the pipeline reuses the cache buffer
        by_group: Dict[int, List[Tuple[int, int, int, WorkItem]]] = {}
        has_master, base, sizes = self.has_master, self.base, self.sizes
        size, groups, numel = self.layout.sub_group_size, self.layout.num_groups, self.layout.numel
        for it in items:
            it = it if isinstance(it, WorkItem) else WorkItem(*it)
            k, lo, hi, grad, out, mode = it.shard, it.lo, it.hi, it.grad, it.out, it.mode
            if grad.numel() != hi - lo or (out is not None and out.numel() != hi - lo):
                raise ValueError(f"shard {k} [{lo}, {hi}): grad of {grad.numel()} and out of "
                                 f"{None if out is None else out.numel()} elements")
            if (mode == "master") == has_master or (mode == "master" and out is None):
                raise ValueError(f"shard {k} [{lo}, {hi}): mode {mode!r} in a store of fields {self.names}: "
                                 "'master' (out is the fp32 master) exactly when the fields have no master")
            a0 = base[k] + lo
            b0, g = a0 + hi - lo, a0 // size
            if 0 <= lo < hi <= sizes[k] and b0 <= numel and g == (b0 - 1) // size < groups:
                by_group.setdefault(g, []).append((a0, b0, a0, it))  # in one sub-group: _spans' one span
                continue
            for g, s, e, a, b in self._spans(k, lo, hi):
                by_group.setdefault(g, []).append((a, b, a0, it))
        self.computed = []
        try:
            with torch.no_grad():
                stats = self.pipeline.run(sorted(by_group), make_compute(self, by_group), extra=self._meta, vote=vote)
        except SwapStepError as exc:
            if not self.has_master:
                raise  # the params are the master: nothing here to restore them from (SwappedState says so)
            raise self._restored(exc, items) from exc
        self.last_stats = stats
        return swap_phases(stats)

    def _decoded(self, pieces, s: int, e: int, tensors: List[torch.Tensor]) -> Optional[DecodedBlocks]:
        """The sub-group's blocked states decoded, when some range of it does not cover whole
        blocks (the rule's fields are all blocked or none: Rule.with_state_dtype); else None."""
        if not self.rule.fields or not self.rule.fields[0].blocked:
            return None
        ends = {self.base[k] + n for k, n in enumerate(self.sizes)}
        if all(whole_blocks(a - s, b - s, e - s, self.padded_ends or b in ends) for a, b, _, _ in pieces):
            return None
        return DecodedBlocks({j: self.fields[j] for j in range(len(self.fields)) if self.fields[j].blocked},
                             tensors, e - s)

    def _rounding(self, it: WorkItem, skip: int, kw: Dict[str, Any]) -> Dict[str, Any]:
        """The kernel's keywords for ``it`` from its element ``skip`` on ([Note: rounding in
        the swapped store] in swapped_ranges.py)."""
        if not (self.rounds or (it.mode == "master" and it.out.dtype == torch.bfloat16)):
            return kw  # fp32 states and master: the kernel's float32 path, no rounding streams
        return rounding_kwargs(kw, it.shard, it.lo + skip, skip, self.stochastic_states)

    def _restored(self, exc: SwapStepError, items: Sequence[WorkItem]) -> BaseException:
        """After a failed step: the outputs of the sub-groups already computed rewritten from
        the master the swap files still hold; the error to raise, saying so."""
        done = set(exc.computed)
        items = [it if isinstance(it, WorkItem) else WorkItem(*it) for it in items]
        outs = [Output(it.shard, it.lo, it.hi, it.out, it.mode) for it in items if it.out is not None
                and any(g in done for g, *_ in self._spans(it.shard, it.lo, it.hi))]
        restored = False
        try:
            self.emit_all(outs)
            what = "the params of the sub-groups already computed were restored from that step"
            restored = True
        except Exception as again:  # the disk is failing: say so rather than hide it
            what = f"restoring the params from that step failed too ({again}): reload them from a checkpoint"
        err = SwapStepError(exc.errno, f"{exc.strerror}; {what}", exc.filename, exc.computed)
        return mark_consistent(err) if restored else err

    # ------------------------------------------------------------------ checkpoints
    @serialized
    def save(self, save_fn: Callable[[Any, List[Any]], Any]) -> Any:
        """Commit pending changes, then let ``save_fn(store, buffers)`` stream the committed
        states out (``offload.zero.checkpoint.save_shards_from_store``)."""
        self.flush()
        self._cache.invalidate()
        return save_fn(self.store, self.pipeline.buffers)

    @serialized
    def load_checkpoint(self, fill: Callable[[Any, List[Any]], Tuple[Dict[str, Any], Dict[int, Any]]],
                        apply_meta: Callable[[Dict[str, Any]], None], vote: Optional[Vote] = None) -> None:
        """Replace every state with what ``fill(store, buffers)`` streams into the free slots
        (it returns (meta, written), as ``offload.swap.checkpoint.load_store``), let
        ``apply_meta(meta)`` update what ``extra()`` reports, then commit both at once: a
        failure before the commit leaves the store as it was. ``vote``: several ranks load
        or none does (``offload.zero.comm.all_or_none``); the caller undoes ``apply_meta``
        when this raises."""
        from offload.zero.comm import all_or_none

        def prepare() -> Tuple[Dict[str, Any], Dict[int, Any]]:
            self.flush()
            self._cache.invalidate()
            out = fill(self.store, self.pipeline.buffers)
            if vote is not None:
                self.store.sync()  # durable before the vote, as a step's writes
            return out

        def commit(prepared: Tuple[Dict[str, Any], Dict[int, Any]]) -> None:
            apply_meta(prepared[0])
            self.store.commit(prepared[1], self._meta(), advance=False, synced=vote is not None)

        def undo() -> str:
            try:
                self.store.undo_commit()
            except OSError as exc:
                return (f"undoing this rank's commit failed too ({exc.strerror or exc}): its swap files hold the "
                        "checkpoint, the other ranks' their state before: load it again")
            return f"this rank's commit was undone: the swap files still hold step {self.store.step}"

        all_or_none(prepare, commit, undo, "load_checkpoint", vote)

    @serialized
    def roll_back(self) -> None:
        """Back to the commit before the last, whose data the free slots still hold: at resume,
        when the other ranks hold that step ([Note: a rank one step ahead] in swap/agreement.py)."""
        self._cache.invalidate()
        self.store.undo_commit()

    # ------------------------------------------------------------------ reporting, closing
    def memory_report(self) -> Dict[str, int]:
        pinned, pageable = self.pipeline.host_bytes_by_kind()
        return {"device": 0, "pinned": pinned, "pageable": pageable, "nvme": self.store.disk_bytes(),
                "io_locked_bytes": self.pipeline.io_locked_bytes}

    @serialized
    def close(self, *, remove: bool = True) -> None:
        """Release the buffers and remove the swap directory (``remove=False``: keep it,
        unlocked, e.g. after a resume that failed: it still holds the last finished step)."""
        self._cache.dirty = False  # nothing to flush: the directory goes, or stays as committed
        self._cache.group = None
        if remove:
            self._finalizer()
            return
        if self._finalizer.detach() is not None:
            # through close_quietly, as the removing close: a forked child closing with
            # keep_swap=True unregistered the buffers on the ring it shares with its parent
            close_quietly(self.pipeline, self.store, remove=False)
