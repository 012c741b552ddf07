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
whose value is still the master's rounding keep the master). A param rebound to other
memory (``p.data = t``, which keeps the param's version) counts as written too: the store
records each param's address beside its version. In-place writes through ``p.data``
(``p.data.copy_(t)``) are not counted by torch (``.data`` has a version counter of its
own), and are not seen here: the README says to write under ``torch.no_grad()`` instead,
or to call ``torch.autograd.graph.increment_version(p)`` after such a write.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

import torch

from offload.memory import paging

if TYPE_CHECKING:  # pragma: no cover
    from offload.optim.flat.store import FlatState


def mark(p: torch.Tensor) -> Tuple[int, int]:
    """What tells that ``p`` was written: its version, and its address (``p.data = t``
    rebinds it to other memory without a new version); 0 for a tensor without one."""
    try:
        address = p.data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without storage of its own)
        address = 0
    return p._version, address


def record(st: "FlatState") -> None:
    """The params as the store wrote them last: their marks now."""
    st._versions = {p: mark(p) for p in st._order}


def changed(st: "FlatState") -> List[torch.Tensor]:
    """Params written by someone else since :func:`record` (new params count as unchanged)."""
    seen = getattr(st, "_versions", {})
    return [p for p in st._order if p in seen and mark(p) != seen[p]]


# The piece of a param taken at a time in RAM (the swapped store's pieces are cut at its
# sub-groups instead): the temporaries of a merge stay a few of these, whatever the param's size.
HOST_CHUNK = 1 << 22


def refresh_changed(st: "FlatState") -> None:
    """The master pieces of the changed params <- their values (this rank's pieces).

    Chunk by chunk (a sub-group of the swap files at a time, each read once and written
    once; in RAM HOST_CHUNK elements): the temporaries stay within a sub-group however large
    the param, and the swap files are not read twice. (Before the twenty-ninth session a
    piece was read whole, then written whole: a bf16 param of 1G elements took ~17 GB of
    temporaries, and every sub-group was loaded twice.)"""
    params = changed(st)
    if not params:
        return
    st._drain()  # copies of the last step may still read the host buffers written below
    touched = set()
    for p in params:
        fg, i = st._where[p]
        piece = fg.layout.owned(i)
        if piece is None:  # another rank's piece
            continue
        if fg.master_lowp:  # a bf16 master: the param itself at one rank, else the rank's bf16 shard
            _own_master_from_param(fg, piece, p)
            continue
        lo, hi, src = _piece_of(fg, piece, p)
        paging.load([src])  # params on NVMe ([Note: paged tensors] in offload/memory/paging.py)
        try:
            k = st._groups.index(fg) if fg.swapped else -1
            for a, b in _chunks(st, k, lo, hi):
                low = src[a - lo:b - lo].to(device="cpu", copy=True)
                if fg.swapped:
                    vals = _merged(low, st._swap.read(k, a, b, ["master"])["master"])
                    st._swap.write(k, a, b, {"master": vals})
                    if fg.lowp_shard is not None:
                        fg.lowp_shard[a:b].copy_(vals)
                else:
                    cur = fg.master[a:b]
                    cur.copy_(_merged(low, cur))
        finally:
            paging.evict([src])
        if not fg.swapped:
            touched.add(fg)
    for fg in touched:
        fg.refresh_lowp_shard()
    record(st)


def _own_master_from_param(fg, piece, p: torch.Tensor) -> None:
    """A bf16 param that is its own master, written by someone else: on several ranks the
    master is this rank's bf16 shard (taken from the params at construction), which the step
    reads and all-gathers over the params, so the write goes into it (one rank: the param is
    the master, nothing to do)."""
    if fg.lowp_shard is None:
        return
    lo, hi, src = _piece_of(fg, piece, p)
    paging.load([src])
    try:
        fg.lowp_shard[lo:hi].copy_(src)
    finally:
        paging.evict([src])


def _piece_of(fg, piece, p: torch.Tensor):
    """``piece``'s [lo, hi) in this rank's shard of ``fg``, and its elements of ``p``."""
    start = fg.layout.shard_range()[0]
    src = p.detach().reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
    return piece.lo - start, piece.hi - start, src


def _merged(low: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """The master ``cur`` where the param ``low`` still holds its rounding, else ``low``.

    An element the write left at the master's rounding keeps its master: a write of the
    same values (p.copy_(same), a clamp_ that clips nothing, torch's test_optim copying
    equal params back) would otherwise round an fp16/bf16 param's fp32 master to the
    param's precision and lose the small updates the master is there to keep."""
    return torch.where(low == cur.to(low.dtype), cur, low.to(torch.float32))


def _chunks(st: "FlatState", k: int, lo: int, hi: int):
    """[a, b) pieces of shard ``k``'s [lo, hi): one per sub-group of the swap files (``k`` >=
    0), else of HOST_CHUNK elements."""
    if k < 0:
        for a in range(lo, hi, HOST_CHUNK):
            yield a, min(hi, a + HOST_CHUNK)
        return
    sw = st._swap
    a0, b0 = sw.base[k] + lo, sw.base[k] + hi
    for g in sw.layout.groups_overlapping(a0, b0):
        s, e = sw.layout.group_range(g)
        yield max(s, a0) - sw.base[k], min(e, b0) - sw.base[k]
