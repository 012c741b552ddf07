"""The swapped store's compute: the kernel over each range of a sub-group (the pipeline's
callback, see ``SwappedShards._step``).

[Note: one kernel call per sub-group] A step of many small params (2000 of 64 elements) is
2000 ranges in one sub-group. Each through ``rule_step`` costs its checks, its packing and a
ctypes call (~20 us, 40 ms of a 60 ms step, bench/model_step.py 2000x64); the ranges of the
float32 path are checked here in a few attribute reads and stepped by one
``checked_rule_steps`` per distinct hyperparameters (the native backend: one
``offload_rule_steps`` call; another backend steps them one by one without checking them
again). The kernel and its constants are the same, so the bits are too. A range that needs
more (compressed states, ranges across blocks, rounding keywords, a bf16 master, another
dtype) goes through ``rule_step`` as before.

[Note: pieces that share memory] Params that are overlapping views of one tensor step as one
after another (tests/test_aliasing.py). A batch keeps that among its own entries (the native
batch runs aliased structs on one thread, in order), but merging the batches of different
hyperparameters (another param group, or a param that sat a step out: another count) reorders
pieces: one of a later batch would run before one of an earlier batch that shares its memory
(SGD with weight decay: another result). So the pieces are kept in their order as runs, merged
per hyperparameters only when no two of the tensors they write (the caller's params or
low-precision copies; the states are the sub-group's own disjoint slices) share a byte.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from offload.kernels._checks import GRAD_DTYPES, LOWP_DTYPES, check_threads
from offload.kernels._rule_step import StepEntry, batchable
from offload.kernels.fields import MASTER
from offload.optim.swapped_ranges import page_in, page_out, storage_slice

__all__ = ["make_compute"]

_ROUNDING_KEYS = ("rounding_seed", "element_offset", "stochastic_states")
_F32 = torch.float32
_BF16 = torch.bfloat16


class _Fixed:
    """The ``hyper`` of ``checked_rule_steps`` for entries that share one kwargs dict."""

    __slots__ = ("kw",)

    def __init__(self, kw: Dict[str, Any]) -> None:
        self.kw = kw

    def kernel_kwargs(self, step: int) -> Dict[str, Any]:
        return dict(self.kw)


def _kw_batched(kw: Dict[str, Any]) -> bool:
    """What ``_batched`` asks of a range's kwargs (shared by the ranges of a batch: asked once
    per kwargs dict a call)."""
    step = kw.get("step")
    return type(step) is int and step >= 1 and not any(k in kw for k in _ROUNDING_KEYS)


def _batched(master: torch.Tensor, grad: torch.Tensor, lowp: Optional[torch.Tensor]) -> bool:
    """Whether a range whose kwargs pass ``_kw_batched`` can join the sub-group's batch: what
    ``rule_step`` would check of it (the states are the buffer's own contiguous float32 slices
    of its size)."""
    return (master.dtype is _F32 and grad.dtype in GRAD_DTYPES and master.is_contiguous() and grad.is_contiguous()
            and (lowp is None or (lowp.dtype in LOWP_DTYPES and lowp.is_contiguous())))


def _split_views(pieces, s: int, n: int, tensors: List[torch.Tensor], idx: List[int]) -> Optional[List[tuple]]:
    """Each piece's views of the float32 states ``idx`` of a sub-group of ``n`` elements from
    ``s``, cut by one ``split`` per state (a slice each cost ~1.5 us a range); None when
    the pieces overlap (then each is sliced on its own)."""
    starts = [piece[0] for piece in pieces]
    order = sorted(range(len(pieces)), key=starts.__getitem__)
    sizes, where, at = [], [0] * len(pieces), s
    for k in order:
        a, b = starts[k], pieces[k][1]
        if a < at:
            return None
        if a > at:
            sizes.append(a - at)  # a gap: no range of this step
        where[k] = len(sizes)
        sizes.append(b - a)
        at = b
    if at < s + n:
        sizes.append(s + n - at)
    cut = [tensors[j].split(sizes) for j in idx]
    if not cut or len(where) < 2:
        return [tuple(c[w] for c in cut) for w in where]
    pick = operator.itemgetter(*where)  # (in C: a tuple per state, then one per piece)
    return list(zip(*[pick(c) for c in cut]))


def _overlap(tensors: List[torch.Tensor]) -> bool:
    """Whether two of ``tensors`` (contiguous) share a byte: one sort of their ranges
    (~0.3 ms for 2000 params)."""
    if len(tensors) < 2:
        return False
    n = len(tensors)
    start = np.fromiter((t.data_ptr() for t in tensors), np.int64, n)
    size = np.fromiter((t.numel() * t.element_size() for t in tensors), np.int64, n)
    order = np.argsort(start, kind="stable")
    start, end = start[order], start[order] + size[order]
    return bool((np.maximum.accumulate(end)[:-1] > start[1:]).any())


def _run(kernel: Any, runs: List[Tuple[Optional[Dict[str, Any]], Any, list]], threads: Any,
         written: List[torch.Tensor]) -> None:
    """Step ``runs`` (piece order: (kwargs, rule, entries) of one batch, or (None, None,
    [a rule_step])) with one kernel call per distinct kwargs (one group's: one rule), or in
    their order when pieces share memory ([Note: pieces that share memory])."""
    if len(runs) > 1 and not _overlap(written):
        merged: Dict[int, Tuple[Dict[str, Any], Any, List[StepEntry]]] = {}
        for kw, rule, entries in runs:
            if kw is None:
                entries[0]()
            else:
                merged.setdefault(id(kw), (kw, rule, []))[2].extend(entries)
        runs = list(merged.values())
    for kw, rule, entries in runs:
        if kw is None:
            entries[0]()
        else:
            kernel.checked_rule_steps(rule, entries, _Fixed(kw), threads)


class _Rules:
    """The store's rule, and the rules of groups that step on some of its fields ([Note:
    groups of different rules] in offload/kernels/fields.py): each with its states' (name,
    index of the field, field) and their positions among the store's states."""

    def __init__(self, shards: Any) -> None:
        self._shards, self._store = shards, shards.rule
        self._plans: Dict[Any, Tuple[Any, list, List[int]]] = {}

    def plan(self, rule: Any) -> Tuple[Any, list, List[int]]:
        """(rule over the store's fields, its states, their positions) of a work item's
        ``rule`` (None: the store's)."""
        out = self._plans.get(rule)
        if out is None:
            r = self._store if rule is None else self._store.narrowed(rule)
            fields = self._shards.fields
            states = [(name, self._shards._field(name), fields[self._shards._field(name)]) for name in r.names]
            out = self._plans[rule] = (r, states, [self._store.names.index(name) for name in r.names])
        return out


def make_compute(shards: Any, by_group: Dict[int, List[Tuple[int, int, int, Any]]]) -> Callable[..., None]:
    """``compute(g, s, e, tensors)`` of the pipeline for ``shards`` (a SwappedShards) over the
    ranges of ``by_group``; ``shards.computed`` lists the sub-groups it entered."""
    kernel, threads, computed = shards._kernel, shards._threads, shards.computed
    jm = shards._field(MASTER.name) if shards.has_master else -1
    rules = _Rules(shards)
    own = rules.plan(None)  # the store's rule: most pieces (looked up per piece only for others)
    states = own[1]
    rounding = shards._rounding
    fast = batchable(shards.rule) and not shards.rounds
    if fast:
        check_threads(threads)  # (rule_step checks it per range)

    def compute(g: int, s: int, e: int, tensors: List[torch.Tensor]) -> None:
        touched = page_in(by_group, g)  # params on NVMe: [Note: paged tensors]
        computed.append(g)  # before the kernel: an exception inside it may have changed params
        dense = shards._decoded(by_group[g], s, e, tensors)  # ranges across blocks: [Note: steps across blocks]
        batched = fast and dense is None
        runs: List[Tuple[Optional[Dict[str, Any]], Any, list]] = []  # in piece order: [Note: pieces that share memory]
        written: List[torch.Tensor] = []  # the caller's tensors the kernels write
        copies = []
        pieces = by_group[g]
        cut = _split_views(pieces, s, e - s, tensors, [j for _, j, _ in states]) if batched else None
        plain = not shards.rounds  # then only a bfloat16 master rounds (shards._rounding's test)
        joins: Dict[int, Tuple[Dict[str, Any], bool]] = {}  # id(kwargs): (kwargs, _kw_batched of them)
        for k, (a, b, start, it) in enumerate(pieces):
            grad, out, mode = it.grad, it.out, it.mode
            rule, mine, at = own if it.rule is None else rules.plan(it.rule)
            whole = a == start and b - start == grad.numel()  # (_whole's test, once a piece)
            y = slice(a - start, b - start)
            master = (out if whole else out[y]) if mode == "master" else tensors[jm][a - s:b - s]
            lowp = (out if whole else out[y]) if (out is not None and mode == "lowp") else None
            kw = it.kwargs
            if not plain or (mode == "master" and out.dtype is _BF16):
                kw = rounding(it, a - start, kw)
            if out is not None and mode != "copy":
                written.append(master if lowp is None else lowp)
            if batched:
                known = joins.get(id(kw))
                if known is None:  # (kept with its kwargs: the id stays theirs for the call)
                    known = joins[id(kw)] = (kw, _kw_batched(kw))
            if batched and known[1] and _batched(master, grad, lowp):
                # float32: the slice is the storage
                if cut is None:
                    views = tuple(tensors[j][a - s:b - s] for _, j, _ in mine)
                else:  # the store's rule: every state, as cut; another's: its own
                    views = cut[k] if it.rule is None else tuple(cut[k][i] for i in at)
                entry = StepEntry(master, grad if whole else grad[y], views, lowp, kw["step"], None)
                if runs and runs[-1][0] is kw:
                    runs[-1][2].append(entry)
                else:
                    runs.append((kw, rule, [entry]))
            else:
                views = {name: storage_slice(f, tensors[j], a - s, b - s) if dense is None
                         else dense.view(j, a - s, b - s) for name, j, f in mine}
                one = functools.partial(kernel.rule_step, rule if dense is None else rule.base, master, grad[y],
                                        views, param_lowp=lowp, num_threads=threads, **kw)
                if batched:
                    runs.append((None, None, [one]))
                else:
                    one()  # nothing deferred: in piece order as it comes
            if out is not None and mode == "copy":
                copies.append((out[y], master))
        _run(kernel, runs, threads, written)
        for dst, master in copies:  # after the kernel that updated master
            dst.copy_(master)
        if dense is not None:
            dense.store()
        page_out(touched)

    return compute
