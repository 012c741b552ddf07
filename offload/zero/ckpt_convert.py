"""A stage-0 checkpoint of other state dtypes, read as float32 values per param.

[Note: converting loads] A stage-0 store (``offload="cpu"`` or ``"nvme"``, params updated in
place) saves its states in the one checkpoint format ([Note: one checkpoint format] in
ckpt_states.py) in the form it keeps them: float32, bfloat16 or packed int8 blocks (the
host store's per-param tensors, small ones left float32, fit no one typed field: it writes
their bytes, [Note: packed host checkpoints] in ckpt_packed.py, decoded here per tensor).
A load whose fields differ from the checkpoint's *only in dtype* (the same states of the
same rule: ``state_dtype`` changed, or a host checkpoint into an int8 swap store) goes
through here: every field is read in its stored
form, decoded to float32 exactly as the stores decode (``quant.decode_blocks``), cut into
one tensor per param, and handed to the loading store, which encodes them as it keeps them
(as ``load_state_dict`` does). The whole checkpoint is then in RAM once as float32 (12 bytes
per param for Adam): a converting load is for moving between kinds of store, not for a
checkpoint larger than RAM. Checkpoints of other ranks' shards (the flat store) and of other
states are refused by the normal path, with its message.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.fields import StateField
from offload.kernels.quant import BLOCK, decode_blocks
from offload.swap.checkpoint import load_tensors
from offload.swap.ckpt_dir import CKPT_MANIFEST, read_manifest
from offload.zero.checkpoint import _check_rank_meta, checkpoint_fields, reading_shards
from offload.zero.ckpt_packed import decode_packed, read_packed

__all__ = ["read_converted"]


def _offsets(numels: Sequence[int], fields: Sequence[StateField]) -> List[int]:
    """Each param's first element in the checkpoint's element space (stage0_numel's layout)."""
    unit = BLOCK if any(f.blocked for f in fields) else 1
    out, total = [], 0
    for n in numels:
        total = -(-total // unit) * unit
        out.append(total)
        total += int(n)
    return out


def _decode(field: StateField, stored: torch.Tensor, numel: int) -> torch.Tensor:
    if field.blocked:
        return decode_blocks(stored, numel, field.signed, field.code)
    return stored.to(torch.float32)


def read_converted(directory: str, numels: Sequence[int],
                   mine: Sequence[StateField]) -> Optional[Tuple[Dict[str, Any], Dict[str, List[torch.Tensor]]]]:
    """(meta, name -> float32 tensor per param) when ``directory`` is a stage-0 checkpoint of
    the fields ``mine`` in other dtypes (see the note); None when the normal load applies (or
    refuses, with its message)."""
    path = os.path.join(directory, "rank0")
    if not os.path.lexists(os.path.join(path, CKPT_MANIFEST)):
        return None
    packed = read_packed(directory, numels, [f.name for f in mine])  # [Note: packed host checkpoints]
    if packed is not None:
        meta, forms, stored = packed
        return meta, decode_packed(forms, stored, numels)
    theirs = checkpoint_fields(read_manifest(path))
    if tuple(theirs) == tuple(mine) or [f.name for f in theirs] != [f.name for f in mine]:
        return None
    with reading_shards(directory):  # no save between the meta's check and the data
        m = read_manifest(path)
        first = m.get("meta") or {}
        if first.get("kind") != "flat" or first.get("world") != 1 or first.get("groups") != [[int(n) for n in numels]]:
            return None
        theirs = checkpoint_fields(m)
        numel = int(m["numel"])
        stored = {f.name: [torch.empty(f.storage_numel(numel), dtype=f.storage_dtype)] for f in theirs}
        meta = load_tensors(path, stored, fields=theirs)
        _check_rank_meta(path, meta, 0, 1, first)
    offsets = _offsets(numels, theirs)
    out: Dict[str, List[torch.Tensor]] = {}
    for f in theirs:
        values = _decode(f, stored.pop(f.name)[0], numel)
        out[f.name] = [values[o:o + int(n)].clone() for o, n in zip(offsets, numels)]
    return meta, out
