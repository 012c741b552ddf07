"""Params changed outside the optimizer: the flat store's master follows them.

[Note: params written by others] The flat store keeps an fp32 master of each param (for
fp32 CPU params too, at stages 1-2 and with offload="nvme"), taken from the params when the
optimizer is built or a state_dict without masters is loaded. torch's optimizers read
``p`` itself at every step, so a ``model.load_state_dict(...)``, ``p.copy_(...)`` or
``offload.shard.load_weights`` after construction changes what the next step starts from;
here the next step started from the old master and silently undid it. Every in-place write
to a tensor bumps its ``_version`` (shared by its views and ``detach()``): the store records
the versions after its own writes (construction, each step's copy back, a load), and a step
that finds one changed takes that param's master piece from the param first (the elements
whose value is still the master's rounding keep the master). Writes through
``p.data`` are not counted by torch (a new version counter), and are not seen here either.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from offload.memory import paging

if TYPE_CHECKING:  # pragma: no cover
    from offload.optim.flat.store import FlatState


def record(st: "FlatState") -> None:
    """The params as the store wrote them last: their versions now."""
    st._versions = {p: p._version for p in st._order}


def changed(st: "FlatState") -> List[torch.Tensor]:
    """Params written by someone else since :func:`record` (new params count as unchanged)."""
    seen = getattr(st, "_versions", {})
    return [p for p in st._order if p in seen and p._version != seen[p]]


def refresh_changed(st: "FlatState") -> None:
    """The master pieces of the changed params <- their values (this rank's pieces)."""
    params = changed(st)
    if not params:
        return
    st._drain()  # copies of the last step may still read the host buffers written below
    touched = set()
    for p in params:
        fg, i = st._where[p]
        piece = fg.layout.owned(i)
        if piece is None or fg.master_lowp:  # another rank's piece; a bf16 master is the param
            continue
        start = fg.layout.shard_range()[0]
        lo, hi = piece.lo - start, piece.hi - start
        src = p.detach().reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
        paging.load([src])  # params on NVMe ([Note: paged tensors] in offload/memory/paging.py)
        low = src.to(device="cpu", copy=True)
        paging.evict([src])
        # An element the write left at the master's rounding keeps its master: a write of the
        # same values (p.copy_(same), a clamp_ that clips nothing, torch's test_optim copying
        # equal params back) would otherwise round an fp16/bf16 param's fp32 master to the
        # param's precision and lose the small updates the master is there to keep.
        cur = st._swap.read(st._groups.index(fg), lo, hi, ["master"])["master"] if fg.swapped \
            else fg.master[lo:hi]
        vals = torch.where(low == cur.to(low.dtype), cur, low.to(torch.float32))
        if fg.swapped:
            st._swap.write(st._groups.index(fg), lo, hi, {"master": vals})
            if fg.lowp_shard is not None:
                fg.lowp_shard[lo:hi].copy_(vals)
        else:
            fg.master[lo:hi].copy_(vals)
            touched.add(fg)
    for fg in touched:
        fg.refresh_lowp_shard()
    record(st)
