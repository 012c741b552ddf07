"""The flat store's state_dict side: full tensors out (``export_state``), loaded tensors in
(``import_state``, ``reset_state``) and the load_state_dict pre / post hooks around torch's
load, which keep the loaded fp32 tensors (torch casts them to the param dtype) and set the
masters.

[Note: state_dict on several ranks] ``state_dict()`` is a collective: call it on every
rank. It returns torch's AdamW layout with full tensors (plus ``master``, the fp32 master,
for fp16/bf16 params), so a checkpoint from N ranks loads on M ranks, in one process, and
into ``torch.optim.AdamW``. With ``opt.state_dict_rank0_only = True`` (the step context's
flag) only rank 0 keeps the full tensors.

[Note: compressed states in state_dict] States stored compressed (bf16, packed int8 blocks)
leave as float32 (decoded: torch's layout) and come in as float32 values that are encoded
(bf16 rounded to nearest even, int8 encoded block by block from the param's first element,
which is a block boundary in the flat layout). With a bf16 master there is no ``master``
entry: the params are the master.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch

from offload.kernels.compressed_ref import decode_state, encode_state
from offload.memory import paging
from offload.zero import comm
from offload.zero.flat_group import FlatGroup, fill_zero_state

if TYPE_CHECKING:
    from offload.optim.flat.store import FlatState

__all__ = ["has_state", "export_state", "gather_full", "import_state", "reset_state", "pre_load", "post_load"]


def has_state(st: "FlatState", p: torch.Tensor) -> bool:
    return st.ctx.steps.has(p)


def export_state(st: "FlatState", p: torch.Tensor) -> Dict[str, torch.Tensor]:
    if not has_state(st, p):
        return {}
    fg, _ = st._where[p]
    keys = st.rule.names + (("master",) if fg.lowp and not fg.master_lowp else ())
    # opt.state_dict_rank0_only = True: every rank takes part in the gather, only rank 0
    # keeps the full tensors (the others' state_dict() then holds only the steps).
    keep = st.rank == 0 or not st.ctx.state_dict_rank0_only
    out = gather_full(st, p, keys, keep=keep)
    return out if keep else {}


def gather_full(st: "FlatState", p: torch.Tensor, keys, keep: bool = True) -> Dict[str, torch.Tensor]:
    """Full-shaped fp32 copies of this param's states; collective when partitioned."""
    fg, i = st._where[p]
    off, n = fg.layout.offsets[i], fg.layout.numels[i]
    full = torch.empty(len(keys), n if keep else 0, dtype=torch.float32)
    S = fg.layout.shard
    for r in range(st.world):
        a, b = max(off, r * S), min(off + n, (r + 1) * S)
        if a >= b:
            continue
        part = torch.empty(len(keys), b - a, dtype=torch.float32, device=st._comm_dev)
        if r == st.rank:
            if fg.swapped:
                vals = st._swap.read(st._groups.index(fg), a - r * S, b - r * S, keys)
            else:
                vals = {key: _values(fg, key, a - r * S, b - r * S) for key in keys}
            for k, key in enumerate(keys):
                part[k].copy_(vals[key])
        if st.world > 1:  # an unpartitioned store (stage 0, 3) in a job of several ranks holds its own states
            comm.broadcast(part, r, st.group)
        if keep:
            full[:, a - off:b - off].copy_(part)
    if not keep:
        return {}
    return {key: full[k].view_as(p).clone() for k, key in enumerate(keys)}


def _values(fg: FlatGroup, key: str, lo: int, hi: int) -> torch.Tensor:
    """The float32 values of field ``key`` at shard-local [lo, hi) ([Note: compressed states in
    state_dict]); a float32 field's own buffer."""
    f = fg.field(key)
    t = fg.state_range(key, lo, hi)
    return t if f.dtype == torch.float32 else decode_state(f, t, hi - lo)


def _store_values(fg: FlatGroup, key: str, lo: int, values: torch.Tensor) -> None:
    """Field ``key`` at shard-local [lo, lo + len(values)) <- ``values``, encoded as the field
    is stored (deterministically: round to nearest for bf16)."""
    f = fg.field(key)
    t = fg.state_range(key, lo, lo + values.numel())
    if f.dtype == torch.float32:
        t.copy_(values)
    else:
        encode_state(f, values.float(), t, stochastic=False, seed=0, offset=0, stream=0, exact=True)


def import_state(st: "FlatState", p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
    # torch's load_state_dict casts floating state to the param's dtype; the pre-load
    # hook kept the original (fp32) tensors, which we prefer.
    full = dict(state)
    full.update(st._stash.get(p, {}))
    fg, i = st._where[p]
    piece = fg.layout.owned(i)
    if piece is None:
        return
    start = fg.layout.shard_range()[0]
    s = slice(piece.lo - start, piece.hi - start)
    ps = slice(piece.param_offset, piece.param_offset + piece.numel)
    if fg.swapped:
        vals = {key: full[key].detach().reshape(-1)[ps].float() for key in st.rule.names if key in full}
        if vals:
            st._swap.write(st._groups.index(fg), s.start, s.stop, vals)
        return
    for key in st.rule.names:
        if key in full:
            _store_values(fg, key, s.start, full[key].detach().reshape(-1)[ps])


def reset_state(st: "FlatState", p: torch.Tensor) -> None:
    """Zero states for ``p`` (loading a state_dict without state for it; as torch)."""
    if p not in st._stepped:
        return  # never stepped: its moments are zeros already (no swap read-modify-write)
    fg, i = st._where[p]
    piece = fg.layout.owned(i)
    if piece is None:
        return
    start = fg.layout.shard_range()[0]
    lo, hi = piece.lo - start, piece.hi - start
    if fg.swapped:
        z = torch.zeros(hi - lo, dtype=torch.float32)
        st._swap.write(st._groups.index(fg), lo, hi, {key: z for key in st.rule.names})
    else:
        for key in st.rule.names:
            fill_zero_state(fg.field(key), fg.state_range(key, lo, hi))


def pre_load(st: "FlatState", order: List[torch.Tensor], state_dict: Dict[str, Any]) -> None:
    """Before torch's load (``order``: the optimizer's params, as the dict numbers them)."""
    st._drain()  # what follows (here, post_load, import/reset_state) rewrites host buffers
    # Params that have moments now (before torch replaces opt.state): only those need
    # reset_state() when the loaded dict has no state for them; the others hold zeros.
    st._stepped = {p for p in st._order if has_state(st, p)}
    st._stash = {}
    # The dict's own param ids, paired with ours in order as torch's load pairs them: they
    # are 0..n-1 in opt.state_dict(), but the FQNs ("layer.weight") in the dicts of
    # torch.distributed.checkpoint's set_optimizer_state_dict / set_state_dict (by index,
    # their masters were dropped and rebuilt from the bf16 params)
    saved = [k for g in state_dict.get("param_groups", ()) for k in g.get("params", ())]
    index = dict(zip(saved, order))
    for k, entry in state_dict.get("state", {}).items():
        p = index.get(k)
        if p is None or p not in st._where:
            continue
        st._stash[p] = {key: entry[key] for key in st.rule.names + ("master",)
                        if isinstance(entry.get(key), torch.Tensor)}


def post_load(st: "FlatState") -> None:
    """Masters from the checkpoint where it has them, else from the params' values. torch
    cast a loaded ``master`` to the param dtype in opt.state: it goes (the fp32 one was kept)."""
    state = st.ctx.torch_state.state if st.ctx.torch_state is not None else {}
    for k, fg in enumerate(st._groups):
        fg.refresh_master()
        start, end = fg.layout.shard_range()
        for pc in fg.layout.pieces(start, end):
            p = fg.params[pc.index]
            entry = state.get(p)
            if entry is not None:
                entry.pop("master", None)  # torch cast it to the param dtype; we keep fp32
            m = st._stash.get(p, {}).get("master")
            s = slice(pc.lo - start, pc.hi - start)
            if m is not None:
                m = m.detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel].float()
            elif fg.swapped:  # params on NVMe read zeros where their pages are out: load them first
                src = p.detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel]
                paging.load([src])
                m = src.to(dtype=torch.float32, copy=True)
                paging.evict([src])
            if m is None or fg.master_lowp:  # a bf16 master: the params are the master
                continue
            if fg.swapped:
                st._swap.write(k, s.start, s.stop, {"master": m})
                if fg.lowp_shard is not None:
                    fg.lowp_shard[s].copy_(m)
            else:
                fg.master[s].copy_(m)
        if not fg.swapped or fg.master_lowp:  # (a bf16 master: the shard <- the params as they are)
            fg.refresh_lowp_shard()
    for p in st._order:
        entry = state.get(p)
        if entry is not None:
            entry.pop("master", None)
