"""``full_state_dict``: the whole model's params as before ``shard()``, gathered unit by unit
and streamed to a file (or returned, for small models).

[Note: streamed safetensors] A safetensors file is an 8-byte little-endian header length, a
JSON header (each tensor's dtype, shape and byte range in the data), then the data. The
header depends only on the names, shapes and dtypes, known before any gather: it is written
first, then each unit is all-gathered (one unit's flat at a time, every rank) and its params'
bytes are appended in the header's order; the file never sits whole in memory. A tied param
is written under each of its names (safetensors has no aliases). ``fmt="torch"`` goes through
such a file (next to ``path``, removed after): ``torch.save`` is given tensors mapped from it
(``numpy.memmap``), so it too reads the bytes from disk as it writes them.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from offload.shard.weights import key_sources, whole_tensor
from offload.zero import comm

__all__ = ["full_state_dict"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
FORMATS = ("safetensors", "torch")


def _gathered(runtime: Any):
    """Each unit's flats, gathered in turn (a collective): yields (flat, its full values)."""
    for u in runtime.units:
        for flat in u.flats:
            full = torch.empty(flat.padded, dtype=flat.dtype)
            comm.all_gather(full, flat.shard_values(), flat.shard._offload_shard.group)
            yield flat, full


def _order(keys: list, slots: dict, runtime: Any, model: nn.Module) -> List[Tuple[str, torch.dtype, torch.Size]]:
    """The file's tensors in the order their bytes come: units' params, then the whole ones."""
    by_src: Dict[str, List[str]] = {}
    for k, src in keys:
        if src is not None:
            by_src.setdefault(src, []).append(k)
    out = []
    for u in runtime.units:
        for flat in u.flats:
            for name, shape in zip(flat.names, flat.shapes):
                out += [(k, flat.dtype, torch.Size(shape)) for k in by_src.get(name, [])]
    for k, src in keys:
        if src is None:
            t = whole_tensor(model, k)
            out.append((k, t.dtype, t.shape))
    return out


def _header(order: list) -> Tuple[bytes, Dict[str, Tuple[int, int]]]:
    head: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    spans, off = {}, 0
    for k, dt, shape in order:
        if dt not in _DTYPES:
            raise TypeError(f"full_state_dict: {k!r} has dtype {dt}, which safetensors cannot hold")
        nb = _numel(shape) * torch.empty((), dtype=dt).element_size()
        head[k] = {"dtype": _DTYPES[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
        spans[k] = (off, off + nb)
        off += nb
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(raw)) + raw, spans


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _write(f: Any, t: torch.Tensor) -> None:
    if t.numel():
        f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


class _Sink:
    """Where the gathered tensors go: a dict, or the file rank 0 streams. A write that fails
    (a full disk) is kept and raised after the last gather, so that the other ranks are never
    left waiting in a collective this rank stopped issuing."""

    def __init__(self, path: Optional[str], head: bytes) -> None:
        self.out: Optional[Dict[str, torch.Tensor]] = None if path else {}
        self.f, self.error, self.path = None, None, path
        if path:
            self._try(lambda: setattr(self, "f", open(path, "wb")))
            self._try(lambda: self.f.write(head))

    def _try(self, fn) -> None:
        if self.error is not None:
            return
        try:
            fn()
        except OSError as e:  # a file's write error says neither which file nor what was written
            self.error = e if e.filename else OSError(e.errno, f"writing the state dict failed: {e.strerror}",
                                                      self.path)

    def put(self, keys: List[str], t: torch.Tensor) -> None:
        if self.out is not None:
            t = t.clone()  # one tensor under every name of a tied param, as torch's state_dict
            for k in keys:
                self.out[k] = t
        else:
            for _ in keys:
                self._try(lambda: _write(self.f, t))

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.error is not None:
            raise self.error


def _stream(model: nn.Module, path: Optional[str]) -> Optional[Dict[str, torch.Tensor]]:
    """Gather unit by unit into a ``_Sink``: the safetensors file at ``path``, or a dict (None)."""
    runtime, keys, slots = key_sources(model)
    by_src: Dict[str, List[str]] = {}
    for k, src in keys:
        if src is not None:
            by_src.setdefault(src, []).append(k)
    sink = _Sink(path, _header(_order(keys, slots, runtime, model))[0] if path else b"")
    try:
        for flat, full in _gathered(runtime):
            for name, shape, (o, n) in zip(flat.names, flat.shapes, flat.slots):
                sink.put(by_src.get(name, []), full[o:o + n].view(shape))
        for k, src in keys:
            if src is None:
                sink.put([k], whole_tensor(model, k).detach())
    finally:
        sink.close()
    return None if sink.out is None else {k: sink.out[k] for k, _ in keys}


def _torch_from(st_path: str, path: str, order: list, keys: list) -> None:
    """``torch.save`` of tensors mapped from the streamed safetensors file (see the note), in
    ``state_dict()``'s key order, a tied param one tensor under its names (as torch saves it)."""
    with open(st_path, "rb") as f:
        start = 8 + struct.unpack("<Q", f.read(8))[0]
    _, spans = _header(order)
    meta = {k: (dt, shape) for k, dt, shape in order}
    sd: Dict[str, torch.Tensor] = {}
    first: Dict[str, torch.Tensor] = {}
    for k, src in keys:
        if src is not None and src in first:
            sd[k] = first[src]
            continue
        (a, b), (dt, shape) = spans[k], meta[k]
        if b == a:
            sd[k] = torch.empty(shape, dtype=dt)
        else:
            arr = np.memmap(st_path, dtype=np.uint8, mode="c", offset=start + a, shape=(b - a,))
            sd[k] = torch.from_numpy(arr).view(dt).view(shape)
        if src is not None:
            first[src] = sd[k]
    torch.save(sd, path)


def full_state_dict(model: nn.Module, path: Any = None, *, rank0_only: bool = True,
                    fmt: str = "safetensors") -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's state dict as ``model.state_dict()`` was before ``shard()`` (every
    name of a tied param, frozen params and persistent buffers too), gathered unit by unit. A
    collective: every rank of the model's group calls it (between steps).

    ``path``: rank 0 streams it to that file (``fmt`` "safetensors", or "torch" for a
    ``torch.save`` file; see the note) and every rank returns None; never whole in memory.
    ``path=None``: returns the dict, whole in memory (for small models), on rank 0 only
    (``rank0_only``; the other ranks get ``{}``, as FSDP's) or on every rank."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if path is not None and not rank0_only:
        raise ValueError("full_state_dict(path=...) writes one file from rank 0: rank0_only=False is for path=None")
    runtime, keys, slots = key_sources(model)
    writer = runtime.rank == 0
    if path is None:
        out = _stream(model, None)
        return out if writer or not rank0_only else {}
    path = os.fspath(path)
    if not writer:
        for _ in _gathered(runtime):  # take part in each unit's gather
            pass
        return None
    tmp = path + ".partial"  # the streamed safetensors file; renamed (or turned into a torch file) when whole
    try:
        _stream(model, tmp)
        if fmt == "torch":
            _torch_from(tmp, path, _order(keys, slots, runtime, model), keys)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return None
