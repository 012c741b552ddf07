"""Streamed weight loading into a sharded model: each rank reads only the slices of the
checkpoint's tensors that fall in its own chunks, unit by unit, never the whole model.

[Note: streamed loading] ``shard()`` records the keys ``model.state_dict()`` had before it
(``record_keys``): a sharded param's under every name it had (tied ones too), frozen params'
and persistent buffers' as they are. A unit's flat (flat_unit.py) lays its params end to end;
param ``j`` is ``[o, o + n)`` of it (``flat.slots``) and this rank's chunk is ``[rank * chunk,
(rank + 1) * chunk)``: the rank reads the overlap of the two from the file (a safetensors
slice of whole rows, or a view of a ``torch.load(mmap=True)`` tensor: pages come in as read)
and writes it into its chunk with ``set_shard_values``. The file is opened again for each
unit, so that the pages a unit mapped are unmapped once it is loaded (they would count in the
process's RSS otherwise). No collective: each rank loads on its own.
"""
from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from offload.memory import heap

__all__ = ["record_keys", "attach", "load_weights", "key_sources", "whole_tensor", "full_keys"]

_KEYS = "_offload_shard_keys"


def record_keys(module: nn.Module, members: List[list]) -> list:
    """``module.state_dict()``'s keys before ``shard()`` changes it: (key, the first name of
    the sharded param it is, or None for a tensor that stays whole)."""
    sharded = {id(p) for ms in members for p, _ in ms}
    first: Dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    keys = [(k, first[id(t)] if id(t) in sharded else None)
            for k, t in module.state_dict(keep_vars=True).items()]
    return keys


def attach(module: nn.Module, runtime: Any, keys: list) -> None:
    """What loading and saving need, kept on the sharded module (``shard()`` calls this)."""
    module.__dict__[_KEYS] = (runtime, keys)


def key_sources(model: nn.Module) -> Tuple[Any, List[Tuple[str, Optional[str]]], Dict[str, Tuple[Any, int]]]:
    """(runtime, the recorded keys, first name -> (flat, slot index)) of a sharded model."""
    if _KEYS not in model.__dict__:
        raise ValueError("expected a module changed by offload.shard()")
    runtime, keys = model.__dict__[_KEYS]
    slots = {name: (flat, j) for u in runtime.units for flat in u.flats for j, name in enumerate(flat.names)}
    return runtime, keys, slots


def full_keys(model: nn.Module) -> set:
    """The keys of the sharded params in ``model.state_dict()`` before ``shard()`` (guards.py)."""
    return {k for k, src in model.__dict__[_KEYS][1] if src is not None}


def whole_tensor(model: nn.Module, key: str) -> torch.Tensor:
    """The frozen param or buffer under ``key`` (left whole by ``shard()``)."""
    prefix, _, attr = key.rpartition(".")
    t = getattr(model.get_submodule(prefix), attr, None)
    if not isinstance(t, torch.Tensor):
        raise NotImplementedError(f"state_dict key {key!r} is not a param or buffer (extra state is not supported)")
    return t


class _Reader:
    """One opening of a checkpoint: keys, shapes, and flat element ranges of a tensor."""

    def __init__(self, path: Any) -> None:
        self.path = path
        if isinstance(path, Mapping):  # a state_dict in memory (model.load_state_dict: guards.py)
            self.sd, self.st = path, None
        elif zipfile.is_zipfile(path):
            sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise TypeError(f"{path}: expected a dict of tensors (a state_dict), got {type(sd).__name__}")
            self.sd, self.st = sd, None
        else:
            from safetensors import safe_open
            self.sd, self.st = None, safe_open(path, framework="pt", device="cpu")

    def keys(self) -> List[str]:
        return list(self.sd.keys() if self.sd is not None else self.st.keys())

    def shape(self, key: str) -> torch.Size:
        if self.sd is not None:
            return self.sd[key].shape
        return torch.Size(self.st.get_slice(key).get_shape())

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, reading little more than them."""
        if self.sd is not None:
            t = self.sd[key]
            return (t.view(-1) if t.is_contiguous() else t.reshape(-1))[start:stop]
        sl = self.st.get_slice(key)
        shape = sl.get_shape()
        if len(shape) == 0:
            return self.st.get_tensor(key).reshape(-1)[start:stop]
        inner = math.prod(shape[1:])
        r0, r1 = start // inner, -(-stop // inner)  # whole rows: a safetensors slice is by the first dim
        return sl[r0:r1].reshape(-1)[start - r0 * inner:stop - r0 * inner]

    def whole(self, key: str) -> torch.Tensor:
        return self.sd[key] if self.sd is not None else self.st.get_tensor(key)

    def close(self) -> None:
        self.sd = self.st = None


def _check_keys(model: nn.Module, keys: list, slots: dict, reader: _Reader, strict: bool):
    """torch's load_state_dict checks, before anything is written: missing and unexpected
    keys (errors when ``strict``), size mismatches (errors always). Returns (missing,
    unexpected, first name -> the file key to read it from)."""
    order = reader.keys()
    have = set(order)
    aliases: Dict[str, List[str]] = {}
    for k, src in keys:
        if src is not None:
            aliases.setdefault(src, []).append(k)
    source: Dict[str, str] = {}
    missing, errors = [], []
    for k, src in keys:
        if src is not None:
            found = [a for a in aliases[src] if a in have]  # a tied param loads from either name
            if not found:
                missing.append(k)
                continue
            if k != found[0]:
                continue
            source[src] = k
            flat, j = slots[src]
            want = flat.shapes[j]
        elif k not in have:
            missing.append(k)
            continue
        else:
            want = whole_tensor(model, k).shape
        got = reader.shape(k)
        if tuple(got) != tuple(want):
            errors.append(f"size mismatch for {k}: copying a param with shape {got} from checkpoint, "
                          f"the shape in current model is {torch.Size(want)}.")
    known = {k for k, _ in keys}
    unexpected = [k for k in order if k not in known]
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
            type(model).__name__, "\n\t".join(errors)))
    return missing, unexpected, source


def _load_flat(flat: Any, source: Dict[str, str], reader: _Reader) -> None:
    """This rank's chunk of one flat <- the overlap of each param's slot with it."""
    lo, hi = flat.rank * flat.chunk, (flat.rank + 1) * flat.chunk
    vals = None
    for name, (o, n) in zip(flat.names, flat.slots):
        s, e = max(o, lo), min(o + n, hi)
        if s >= e or name not in source:
            continue
        if vals is None:
            vals = flat.shard_values()
        vals[s - lo:e - lo] = reader.read(source[name], s - o, e - o)  # cast to the params' dtype
    if vals is not None:
        flat.set_shard_values(vals)


@torch.no_grad()
def load_weights(model: nn.Module, path: Any, *, strict: bool = True):
    """Load a checkpoint of the model as it was before ``shard()`` (a torch file, loaded with
    ``mmap=True``, a safetensors file, or such a state_dict itself) into a sharded model, unit
    by unit, each rank its own slices only (see the note). Keys as ``model.state_dict()``
    before ``shard()``; a tied param loads from either of its names. ``strict``: missing or
    unexpected keys raise, as ``load_state_dict`` (a size mismatch always raises; nothing is
    written then). Returns ``(missing_keys, unexpected_keys)``. Not a collective."""
    if not isinstance(path, Mapping):  # else a state_dict itself (model.load_state_dict: guards.py)
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}")
    runtime, keys, slots = key_sources(model)
    reader = _Reader(path)
    try:
        missing, unexpected, source = _check_keys(model, keys, slots, reader, strict)
        for k, src in keys:
            if src is None and k not in missing:
                whole_tensor(model, k).copy_(reader.whole(k))
    finally:
        reader.close()
    for u in runtime.units:
        reader = _Reader(path)  # see the note: this unit's mapped pages go with it
        try:
            for flat in u.flats:
                _load_flat(flat, source, reader)
        finally:
            reader.close()
        heap.trim_heap()  # the unit's reads (materialize.py says why, at its own trim)
    return _IncompatibleKeys(missing, unexpected)
