"""Stage-0 checkpoints of per-param tensors of mixed stored forms, written as their bytes.

[Note: packed host checkpoints] The host store (fp32 CPU params, ``offload="none"`` or
``"cpu"``) with compressed states keeps each param's states as tensors of their own: packed
int8 blocks or bf16 for a param of at least ``MIN_COMPRESSED_NUMEL`` elements, float32 for a
smaller one (optim/host_state.py). No one typed field holds both, and decoding them to
float32 for the checkpoint would make it as large as a float32 one (8 B per param for
Adam's two states instead of about 2 with int8). So such a checkpoint is the one checkpoint
format ([Note: one checkpoint format] in ckpt_states.py, ``DIR/rank0/``) whose fields are
bytes (uint8, no block; named ``<state>__bytes``): each state's file holds every param's stored tensor, byte
for byte, one after the other, and the manifest's meta ``tensors`` says per state and param
the ``[dtype, block, code]`` of its bytes (``[dtype, block]`` for a per-element form, and in
the first int8 checkpoints, whose uint8 blocks are then the "unsigned" code). Temp names, renames, crc32s and the lock are those of every checkpoint
(``save_tensors`` / ``load_tensors``). No store keeps such states, so a store (or a release)
that does not read this form refuses it (its states differ; the message names both) rather
than misreading it; the stage-0 stores read it through :func:`read_packed`: the host
store keeps each tensor whose form is the one it stores bit for bit and decodes the others,
the swapped store decodes all of them ([Note: converting loads] in ckpt_convert.py).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels.compressed_ref import decode_state
from offload.kernels.fields import StateField
from offload.swap.ckpt_dir import CKPT_MANIFEST, read_manifest
from offload.zero.checkpoint import _flat_meta, _rank_dir, reading_shards
from offload.zero.ckpt_states import load_states, save_states

__all__ = ["TENSORS", "is_packed", "save_packed", "read_packed", "decode_packed", "saved_names"]

TENSORS = "tensors"
"""The meta key of a packed checkpoint: state name -> one ``[dtype, block]`` per param."""
BYTES = "__bytes"
"""What a packed checkpoint's state names end in (``exp_avg__bytes``): a reader that knows
no packed checkpoint finds other states than its own and refuses it, where the same names
in another dtype would have it decode the bytes as values ([Note: converting loads])."""

Forms = Dict[str, List[StateField]]


def is_packed(meta: Dict[str, Any]) -> bool:
    """Whether a checkpoint's meta is that of a packed checkpoint (see the note)."""
    return isinstance(meta, dict) and TENSORS in meta


def _byte_fields(names: Sequence[str]) -> Tuple[StateField, ...]:
    """The manifest's fields of the states ``names``: bytes."""
    return tuple(StateField(k + BYTES, torch.uint8) for k in names)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (a view; a copy only of a non-contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _total(forms: List[StateField], numels: Sequence[int]) -> int:
    return sum(f.nbytes(int(n)) for f, n in zip(forms, numels))


def save_packed(directory: str, numels: Sequence[int], states: Dict[str, List[torch.Tensor]], forms: Forms,
                meta: Dict[str, Any]) -> str:
    """Write ``states`` (name -> each param's stored tensor, in order), stored as ``forms``
    (name -> each param's field), as ``DIR/rank0/`` (see the note)."""
    data: Dict[str, List[torch.Tensor]] = {}
    for k, tensors in states.items():
        data[k + BYTES] = [_bytes(t) for t in tensors]
        for i, (b, f, n) in enumerate(zip(data[k + BYTES], forms[k], numels)):
            if b.numel() != f.nbytes(int(n)):  # what a load would cut the file by
                raise ValueError(f"state {k!r} of param {i} ({n} elements, {f.describe()}) has {b.numel()} bytes, "
                                 f"expected {f.nbytes(int(n))}")
    tensors_meta = {k: [[f.dtype_name, f.block] + ([f.code] if f.block else []) for f in forms[k]] for k in states}
    total = _total(forms[next(iter(states))], numels) if states else 0
    return save_states(directory, numels, data, dict(meta, **{TENSORS: tensors_meta}),
                       fields=_byte_fields(list(states)), numel=total)


def _form(name: str, entry: Any) -> StateField:
    """A state's field from its meta entry ``[dtype, block]`` or ``[dtype, block, code]``
    (the first int8 checkpoints wrote no code: StateField.from_description's default)."""
    if not isinstance(entry, (list, tuple)) or len(entry) not in (2, 3):
        raise ValueError(f"expected [dtype, block] or [dtype, block, code], got {entry!r}")
    d = {"name": name, "dtype": entry[0], "block": entry[1]}
    if len(entry) == 3:
        d["code"] = entry[2]
    return StateField.from_description(d)


def _forms(path: str, m: Dict[str, Any], numels: Sequence[int], states: List[str]) -> Forms:
    """Each of ``states``' per-param fields as manifest ``m`` (of ``path``) says, checked
    against the params' numels and the bytes the manifest counts."""
    said = (m.get("meta") or {}).get(TENSORS)
    where = os.path.join(path, CKPT_MANIFEST)
    if not isinstance(said, dict) or sorted(said) != sorted(states):
        raise ValueError(f"{where}: the meta's {TENSORS!r} names the states "
                         f"{sorted(said) if isinstance(said, dict) else repr(said)[:80]}, the checkpoint holds "
                         f"{[k + BYTES for k in states]}")
    forms: Forms = {}
    for k in states:
        entries = said[k]
        if not isinstance(entries, list) or len(entries) != len(numels):
            raise ValueError(f"{where}: the meta's {TENSORS!r} lists {len(entries) if isinstance(entries, list) else '?'} "
                             f"forms of {k!r}, for {len(numels)} params")
        try:
            forms[k] = [_form(k, e) for e in entries]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: a form of {k!r} in the meta's {TENSORS!r} is not a state field: {exc}") from None
        if _total(forms[k], numels) != m.get("numel"):
            raise ValueError(f"{where}: the forms of {k!r} take {_total(forms[k], numels)} bytes, the manifest "
                             f"counts {m.get('numel')}")
    return forms


def read_packed(directory: str, numels: Sequence[int], names: Sequence[str]
                ) -> Optional[Tuple[Dict[str, Any], Forms, Dict[str, List[torch.Tensor]]]]:
    """(meta, forms, name -> each param's stored tensor, 1-D) of packed checkpoint
    ``directory`` of params of ``numels`` and the states ``names``; None when ``directory``
    holds another kind or other states (the caller's normal load reads it, or refuses it
    with its message). Checked by its crc32s as it reads."""
    path = _rank_dir(directory, 0)
    if not os.path.lexists(os.path.join(path, CKPT_MANIFEST)):
        return None
    names = list(names)
    if not names:
        return None  # a rule without state: no bytes to pack, the normal load reads its steps
    if list(read_manifest(path).get("states") or []) != [f.name for f in _byte_fields(names)]:
        return None  # another kind of checkpoint, or other states
    mine = [[int(n) for n in numels]]
    with reading_shards(directory):  # no save between the manifest read here and the data
        m = read_manifest(path)
        _flat_meta(directory, mine, _byte_fields(names))  # these params (else its message)
        forms = _forms(path, m, numels, names)
        stored = {k: [torch.empty(f.storage_numel(int(n)), dtype=f.storage_dtype) for f, n in zip(forms[k], numels)]
                  for k in names}
        meta = load_states(directory, numels, {k + BYTES: [_bytes(t) for t in v] for k, v in stored.items()},
                           _byte_fields(names))
    if meta.get(TENSORS) != m["meta"].get(TENSORS):  # (the lock makes this impossible; cheap to say)
        raise ValueError(f"{path}: the checkpoint changed while it was read; load it again")
    return meta, forms, stored


def decode_packed(forms: Forms, stored: Dict[str, List[torch.Tensor]],
                  numels: Sequence[int]) -> Dict[str, List[torch.Tensor]]:
    """Name -> each param's float32 values (1-D), decoded as the stores decode them."""
    return {k: [decode_state(f, t, int(n)) for f, t, n in zip(forms[k], stored[k], numels)] for k in forms}


def saved_names(directory: str) -> Tuple[str, ...]:
    """The states a stage-0 checkpoint ``directory`` holds (a packed one's by their own
    names; the previous release's single directory too); () without a manifest (the load
    says what is missing)."""
    path = _rank_dir(directory, 0)
    if not os.path.lexists(os.path.join(path, CKPT_MANIFEST)):
        path = directory
    if not os.path.lexists(os.path.join(path, CKPT_MANIFEST)):
        return ()
    m = read_manifest(path)
    names = m.get("states") or list(m.get("files") or {})
    return tuple(n[:-len(BYTES)] if n.endswith(BYTES) else n for n in names)
