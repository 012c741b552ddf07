"""The flat store's step loops over host buffers: one rank (each param stepped and sent in
sub-groups) and several ranks (the shard stepped bucket by bucket, each bucket all-gathered
as soon as it is done). The swapped step is in ``swapped.py``.

Three loops remain (these two and the swapped one); replacing them by one loop over work
items that asks the grad source for the grad slice and the sink for the output is the next
step of issue #14.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Dict, Tuple

import torch

from offload.optim.flat.sinks import BucketGathers
from offload.zero import split_ranges
from offload.zero.flat_group import FlatGroup

if TYPE_CHECKING:
    from offload.optim.flat.store import FlatState

__all__ = ["step_local", "step_partitioned"]


def step_local(st: "FlatState", kernel, batches, t_grads: float) -> Dict[str, float]:
    """One rank, host buffers: every param with a grad, in order."""
    t_kernel = t_h2d = 0.0
    for hyper, items in batches:
        kw_base = None
        for p, g, step in items:
            fg, i = st._where[p]
            if kw_base is None or kw_base[0] != step:
                kw_base = (step, hyper.kernel_kwargs(step))
            tk, th = _step_param(st, kernel, fg, i, g, kw_base[1])
            t_kernel += tk
            t_h2d += th
    st._sink.end()
    return {"grad_transfer": t_grads, "kernel": t_kernel, "h2d": t_h2d, "allgather": 0.0}


def _kernel_kwargs(st: "FlatState", batches) -> Dict[Tuple[int, int], dict]:
    """Several ranks: the kernel's keywords per (group, param index), the 1/N folded in."""
    kws: Dict[Tuple[int, int], dict] = {}
    for hyper, items in batches:
        hyper = dataclasses.replace(hyper, grad_scale=hyper.grad_scale * st._grads.factor)
        by_step: Dict[int, dict] = {}
        for p, _, step in items:
            fg, i = st._where[p]
            if step not in by_step:
                by_step[step] = hyper.kernel_kwargs(step)
            kws[(id(fg), i)] = by_step[step]
    return kws


def step_partitioned(st: "FlatState", kernel, batches, t_grads: float) -> Dict[str, float]:
    """Several ranks, host buffers: [Note: all-gather overlap] in sinks.py."""
    kws = _kernel_kwargs(st, batches)
    t_kernel = t_ag = 0.0
    for fg in st._groups:
        start = fg.layout.shard_range()[0]
        gathers = BucketGathers(fg, st.group)
        for k, (a, b) in enumerate(fg.bucket_ranges()):
            t = time.perf_counter()
            for pc in fg.layout.pieces(start + a, start + b):
                kw = kws.get((id(fg), pc.index))
                if kw is None:
                    continue  # no grad on any rank this step: not stepped (as torch)
                s = slice(pc.lo - start, pc.hi - start)
                kernel.adam_step(fg.master[s], fg.gshard[s], fg.exp_avg[s], fg.exp_avg_sq[s],
                                 param_lowp=fg.lowp_shard[s] if fg.lowp else None,
                                 num_threads=st._threads, **kw)
            t1 = time.perf_counter()
            t_kernel += t1 - t
            gathers.start(k, a, b)
            t_ag += time.perf_counter() - t1
        t = time.perf_counter()
        gathers.finish()
        t_ag += time.perf_counter() - t
    return {"grad_transfer": t_grads, "kernel": t_kernel, "h2d": 0.0, "allgather": t_ag}


def _step_param(st: "FlatState", kernel, fg: FlatGroup, i: int, g: torch.Tensor, kw: dict) -> Tuple[float, float]:
    """One rank: step param ``i`` (cut into sub-groups for CUDA params) and send it."""
    piece = fg.layout.owned(i)
    if piece is None:
        return 0.0, 0.0
    start = fg.layout.shard_range()[0]
    off = fg.layout.offsets[i]
    p = fg.params[i]
    grad, gbase = st._grads.local(fg, i, g), -off
    pflat = fg.flat_param(i)
    copy_back = False
    if pflat is None:  # non-contiguous CPU param: update a copy
        pflat, copy_back = p.detach().reshape(-1).clone(), True
    # Where the kernel writes the low-precision copy of the updated master, and what
    # goes to the param after the kernel.
    lowp, lbase, send = None, 0, None
    if fg.stage is not None:
        lowp, lbase, send = fg.stage, -start, fg.stage  # CUDA bf16/fp16: via pinned staging
    elif fg.lowp:
        lowp, lbase = pflat, -off  # CPU bf16/fp16: straight into the param
    else:
        send = fg.master  # fp32 params: the master itself is copied
    t_kernel = t_h2d = 0.0
    sub = st._sub if (p.device in st._streams or st._sub_user) else piece.numel
    for a, b in split_ranges(piece.lo, piece.hi, sub):
        s = slice(a - start, b - start)
        t = time.perf_counter()
        kernel.adam_step(
            fg.master[s], grad[a + gbase:b + gbase], fg.exp_avg[s], fg.exp_avg_sq[s],
            param_lowp=None if lowp is None else lowp[a + lbase:b + lbase],
            num_threads=st._threads, **kw)
        t_kernel += time.perf_counter() - t
        if send is not None:
            # Send this sub-group to the param; on CUDA the copy stream does it while
            # the CPU computes the next sub-group.
            t = time.perf_counter()
            st._sink.to_param(pflat[a - off:b - off], send[s])
            t_h2d += time.perf_counter() - t
    if copy_back:
        p.detach().copy_(pflat.view_as(p))
    return t_kernel, t_h2d
