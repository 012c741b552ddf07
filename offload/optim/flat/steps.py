"""The flat store's one step loop: work items, each computed by the state backing.

[Note: one step loop] A step walks this rank's shard group by group, and each group in
*segments*: the buckets whose all-gather starts as soon as they are stepped (several ranks,
host buffers: [Note: all-gather overlap] in sinks.py), else the whole shard. Each (param ∩
segment) piece that has a grad this step becomes work items (``WorkItem``), cut into
sub-groups where the host-to-device copies are paced by them:

- the grad source gives the item's grad slice (``GradSource.piece``);
- the param sink gives its output: where the kernel writes the low-precision copy of the
  updated master (``mode="lowp"``), or where the master is copied (``"copy"``), and what
  is sent to the param once the item is computed (``then``): ``ParamSink.piece_output``;
- the state backing computes it: ``HostBacking`` (host buffers: the kernel now, then the
  sends, each sub-group's copy to the device overlapping the next sub-group's kernel) or
  ``SwapBacking`` (swap files, ``swapped.py``: the items are collected and the swap pipeline
  streams them; the sends and the all-gather follow the commit).

Stage 3 adds a grad source and a sink; a new state backing needs only ``compute`` and
``finish``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple

import torch

from offload.kernels.fields import Rule
from offload.kernels.quant import rounding_seed
from offload.memory import paging
from offload.optim.state_codec import STOCHASTIC_BF16_STATES
from offload.zero import split_ranges
from offload.optim.swapped_shards import WorkItem
from offload.zero.flat_group import FlatGroup

if TYPE_CHECKING:
    from offload.optim.flat.store import FlatState

__all__ = ["WorkItem", "HostBacking", "run_step"]


Todo = Dict[Tuple[int, int], Tuple[Dict[str, Any], torch.Tensor, Optional[Rule]]]


def _todo(st: "FlatState", batches) -> Todo:
    """(id(group), param index) -> (kernel keywords, grad, rule) of every param stepped now
    (rule: None for the store's, else a group's whose fields the store's holds); the 1/N of
    a sum over N ranks folded into the grad scale."""
    todo: Todo = {}
    factor = st._grads.factor if st.world > 1 else 1.0
    for hyper, items in batches:
        rule = getattr(hyper, "rule", st.rule.base)  # the float32 rule; the store's keeps its states compressed
        if items and not st.rule.holds(rule):
            raise ValueError(f"a step of rule {rule.name!r} in a flat store of rule {st.rule.name!r} (states "
                             f"{list(st.rule.names)}); build a new optimizer after changing what the groups "
                             "need (e.g. SGD's momentum from 0, amsgrad)")
        rule = None if rule is st.rule.base else rule
        if factor != 1.0:
            hyper = dataclasses.replace(hyper, grad_scale=hyper.grad_scale * factor)
        by_step: Dict[int, dict] = {}
        for p, g, step in items:
            fg, i = st._where[p]
            if step not in by_step:
                by_step[step] = hyper.kernel_kwargs(step)
            todo[(id(fg), i)] = (by_step[step], g, rule)
    return todo


def _piece_items(st: "FlatState", k: int, fg: FlatGroup, pc, start: int, kw: dict, g: torch.Tensor,
                 rule: Optional[Rule], cut: bool) -> Iterator[WorkItem]:
    """The items of one (param ∩ segment) piece: one, or one per sub-group when ``cut`` and
    the param's copies are paced by sub-groups (device params, or a sub_group_size given)."""
    lo = pc.lo - start
    grad = st._grads.piece(fg, pc.index, pc, start, g)
    out, mode, send_to, finish = st._sink.piece_output(fg, pc, start)
    paced = cut and (fg.device in st._streams or st._sub_user)
    subs = split_ranges(0, pc.numel, st._sub) if paced else [(0, pc.numel)]
    for a, b in subs:
        then = st._sink.after(out, send_to, a, b, finish if b == pc.numel else None)
        yield WorkItem(k, lo + a, lo + b, grad[a:b], _rounding(fg, k, lo + a, kw),
                       None if out is None else out[a:b], mode, then, rule)


def _rounding(fg: FlatGroup, k: int, lo: int, kw: dict) -> dict:
    """``kw`` with the item's rounding streams ([Note: compressed states in the flat store]):
    a seed of the step and the group, the offset of the item's first element in the whole
    flat group (not the rank's shard), so N ranks, and host or swap backings, give the same
    bits. Items of fp32 states and an fp32 master keep ``kw`` as it is."""
    if not fg.compressed:
        return kw
    return dict(kw, rounding_seed=rounding_seed(kw["step"], k),
                element_offset=fg.layout.shard_range()[0] + lo,
                stochastic_states=STOCHASTIC_BF16_STATES)


def run_step(st: "FlatState", backing: Any, batches, phases: Dict[str, float]) -> Dict[str, float]:
    """[Note: one step loop]: every group, segment and piece with a grad, through ``backing``
    (``compute(item)`` for each, ``finish()`` at the end); the sink's segment and group
    ends start and finish the all-gathers. Seconds per phase added to ``phases``."""
    todo = _todo(st, batches)
    sink, cut = st._sink, backing.cuts
    for k, fg in enumerate(st._groups):
        start = fg.layout.shard_range()[0]
        for n, (a, b) in enumerate(sink.segments(fg)):
            for pc in fg.layout.pieces(start + a, start + b):
                job = todo.get((id(fg), pc.index))
                if job is None:
                    continue  # no grad on any rank this step: not stepped (as torch)
                for item in _piece_items(st, k, fg, pc, start, *job, cut):
                    backing.compute(item)
            t = time.perf_counter()
            sink.segment_done(fg, n, a, b)
            phases["allgather"] += time.perf_counter() - t
        t = time.perf_counter()
        sink.group_done(fg)
        phases["allgather"] += time.perf_counter() - t
    backing.finish(phases)
    sink.end()  # the next forward reads the params copied
    return phases


class HostBacking:
    """The states in host buffers (``FlatGroup.master`` and the rule's: ``exp_avg``, ...): an
    item is computed at once, then sent (on a device's copy stream, overlapping the next)."""

    cuts = True

    def __init__(self, st: "FlatState", kernel: Any, phases: Dict[str, float]) -> None:
        self._groups, self._sink, self._threads = st._groups, st._sink, st._threads
        self._kernel, self._phases = kernel, phases

    def compute(self, item: WorkItem) -> None:
        fg = self._groups[item.shard]
        s = slice(item.lo, item.hi)
        t = time.perf_counter()
        rule = fg.rule if item.rule is None else fg.rule.narrowed(item.rule)  # a group's own fields
        paging.load([item.grad])  # params on NVMe: [Note: paged tensors] in offload/memory/paging.py
        (paging.load if fg.master_lowp else paging.will_write)([item.out])
        if fg.layout.align == 1:  # one stored element per value (fp32, bf16): plain slices
            states = {k: getattr(fg, k)[s] for k in rule.names}
        else:  # packed int8 blocks: the bytes of the item's blocks
            states = {k: fg.state_range(k, item.lo, item.hi) for k in rule.names}
        if fg.master_lowp:  # the output is the bf16 master, stepped in place ([Note: bf16 master])
            param, lowp = item.out, None
        else:
            param, lowp = fg.master[s], item.out if item.mode == "lowp" else None
        self._kernel.rule_step(rule, param, item.grad, states, param_lowp=lowp,
                               num_threads=self._threads, **item.kwargs)
        t1 = time.perf_counter()
        self._phases["kernel"] += t1 - t
        if item.mode == "copy":
            self._sink.to_param(item.out, fg.master[s])  # fp32 params: the master itself
        if item.then is not None:
            item.then()
        paging.store([item.out])
        paging.evict([item.grad, item.out])
        self._phases["h2d"] += time.perf_counter() - t1

    def finish(self, phases: Dict[str, float]) -> None:
        pass
