"""The fingerprint of bf16 params that are their own master, in the flat store's swap files.

[Note: own-master fingerprint] With ``master_dtype="bfloat16"`` the bf16 params are the
master ([Note: bf16 master] in offload/zero/flat_group.py) and the swap files hold only the
rule's states: a crash loses the params with the process. ``resume=True`` used to take the
states of step N and go on from whatever params the new process built (its initial weights),
silently. As for fp32 params updated in place ([Note: fingerprint] in
offload/optim/fingerprint.py), each commit now records a crc32 of a sample of this rank's
params with the step (the manifest's ``extra``), and a resume refuses params that do not
match it: the user loads the params of that step first (the model's own checkpoint).

The sample is a few shard-local elements per param piece (its first and last and up to 8
spread over it). At a commit they are read where the step wrote them: the rank's bf16
shard (several ranks, all-gathered after the commit), the pinned stage (device params,
copied after it), else the params themselves; at a resume, from the params the user loaded.
Pieces of a non-contiguous param at one rank (stepped through a copy put back after the
commit) and params paged to NVMe (offload.shard's tier: a read would page them in) are
left out of both.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from offload.memory import paging
from offload.swap.runs import ParamsMismatch

if TYPE_CHECKING:  # pragma: no cover
    from offload.optim.flat.store import FlatState

__all__ = ["KEY", "fingerprint", "check_at_open", "check_resumed"]

KEY = "own_master_fingerprint"
_SPREAD = 8


def _samples(st: "FlatState", fg) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """(param index, shard-local indices, param-local indices) of each sampled piece of ``fg``;
    built once per group (the layout, the params and their paging do not change), as each
    commit reads them."""
    cache = st.__dict__.setdefault("_own_master_samples", {})
    if id(fg) not in cache:
        cache[id(fg)] = _build_samples(fg)
    return cache[id(fg)]


def _build_samples(fg) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    start = fg.layout.shard_range()[0]
    out = []
    for pc in fg.layout.pieces(start, start + fg.layout.shard):
        p = fg.params[pc.index]
        if paging.paged(p) or (fg.lowp_shard is None and fg.stage is None and not p.is_contiguous()):
            continue
        n = pc.numel
        k = min(_SPREAD, n)
        local = sorted({0, n - 1} | {(n - 1) * j // max(1, k - 1) for j in range(k)}) if n else []
        idx = torch.tensor(local, dtype=torch.int64)
        out.append((pc.index, idx + (pc.lo - start), idx + pc.param_offset))
    return out


def fingerprint(st: "FlatState", from_params: bool = False) -> Optional[str]:
    """crc32 of this rank's sampled own-master values as 8 hex digits (None without such
    groups): as a step left them (the shard or stage it wrote), or ``from_params``."""
    groups = [fg for fg in st._groups if fg.master_lowp]
    if not groups:
        return None
    crc = 0
    with torch.no_grad():
        for fg in groups:
            written = None if from_params else (fg.lowp_shard if fg.lowp_shard is not None else fg.stage)
            for i, shard_idx, param_idx in _samples(st, fg):
                if written is not None:
                    vals = written[shard_idx]
                else:
                    vals = fg.params[i].detach().reshape(-1)[param_idx].to(device="cpu", dtype=torch.bfloat16)
                crc = zlib.crc32(vals.contiguous().view(torch.int16).numpy().tobytes(), crc)
    return f"{crc:08x}"


def check_at_open(st: "FlatState", extra: Dict[str, Any], store: Any) -> bool:
    """A one-rank resume's check of each directory of these params' shapes as it is opened:
    whether the fingerprint it records is these params' (False: none recorded), ParamsMismatch
    for other values, so that the next directory of the shapes is tried ([Note: same identity]
    in swap/runs.py). Several ranks check after agreeing on the step (check_resumed): a rank
    one step ahead goes back, and its fingerprint with it."""
    recorded = extra.get(KEY)
    if recorded is None:
        return False
    now = fingerprint(st, from_params=True)
    if now != recorded:
        raise ParamsMismatch(_refusal(store.path, store.step, now, recorded))
    return True


def check_resumed(st: "FlatState", swap_dir: str) -> None:
    """After a resume: ValueError when the params are not those the resumed step left."""
    recorded = st._swap.resumed_extra.get(KEY) if st._swap is not None else None
    if recorded is None:
        return  # no own-master group, or a manifest written before the fingerprint was kept
    now = fingerprint(st, from_params=True)
    if now != recorded:
        raise ValueError(_refusal(swap_dir, st._swap.store.step, now, recorded))


def _refusal(where: str, step: Any, now: Optional[str], recorded: str) -> str:
    return (f"resume: the bf16 params are not those of step {step} that the swap files in {where!r} hold "
            f"(fingerprint {now} != {recorded}). With master_dtype='bfloat16' the params are their own master and "
            "the swap files keep only the optimizer states, so a crash loses them: load the params of that step "
            "first (the model's checkpoint), or start afresh with resume='discard'")
