"""Checkpoints of fp32 params updated in place (stage 0) in the one checkpoint format.

[Note: one checkpoint format] Every store saves per-rank shards, ``DIR/rank<r>/`` ([Note:
flat checkpoints] in zero/checkpoint.py), each manifest naming its typed fields (names and
dtypes). Stage 0 is the one-rank case: its params laid end to end are one flat group of
one shard (world 1, rank 0), and its fields are Adam's only, the params being their own
master. So ``offload="cpu"`` (host tensors, ``HostState``) and ``"nvme"`` (swap files,
``SwappedState``) read and write the same files, through the same checks as the flat
store, which N -> M reshards; a load refuses a checkpoint of other fields, naming both.
(The host store's compressed states, per-param tensors of two forms, are written as their
bytes: [Note: packed host checkpoints] in ckpt_packed.py.)

The previous release wrote stage 0 into ``DIR`` itself (``DIR/offload-ckpt.json``): such a
checkpoint still loads, and the first save in this format into ``DIR`` retires its files.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from offload.kernels.fields import StateField
from offload.kernels.quant import BLOCK
from offload.swap.checkpoint import load_store, load_tensors, save_tensors
from offload.swap.ckpt_dir import CKPT_MANIFEST, retire_single_directory
from offload.zero.checkpoint import (IN_PLACE_FIELDS, _check_rank_meta, _flat_meta, _rank_dir, _save_on_every_rank,
                                     fill_store_from_shards, reading_shards, save_shards_from_store)
from offload.zero.partition import FlatLayout

__all__ = ["save_states", "load_states", "save_store_states", "fill_store_states", "stage0_numel"]


def _meta(numels: Sequence[int], meta: Dict[str, Any]) -> Dict[str, Any]:
    return dict(meta, kind="flat", world=1, rank=0, groups=[[int(n) for n in numels]])


def _single(directory: str) -> bool:
    """``directory`` holds a checkpoint of the previous release's single-directory format."""
    return (not os.path.lexists(os.path.join(directory, "rank0", CKPT_MANIFEST))
            and os.path.lexists(os.path.join(directory, CKPT_MANIFEST)))


def stage0_numel(numels: Sequence[int], fields: Sequence[StateField]) -> int:
    """Elements of stage 0's element space: the params end to end, each on whole blocks with
    packed int8 fields (as SwappedState lays them out: a param's packed blocks are its own,
    the bytes of the host store's per-param tensors one after the other)."""
    unit = BLOCK if any(f.blocked for f in fields) else 1
    total = 0
    for n in numels:
        total = -(-total // unit) * unit + int(n)
    return total


def save_states(directory: str, numels: Sequence[int], states: Dict[str, List[Any]], meta: Dict[str, Any],
                fields: Optional[Sequence[StateField]] = None, numel: Optional[int] = None) -> str:
    """Host tensors (name -> one tensor per param, in order) as ``DIR/rank0/``; ``fields``:
    their typed fields (needed for packed int8 tensors, laid out as ``stage0_numel`` says);
    ``numel``: the values per state when they are not the params' (the bytes of [Note:
    packed host checkpoints] in ckpt_packed.py)."""
    full = _meta(numels, meta)
    if numel is None and fields is not None:
        numel = stage0_numel(numels, fields)
    _save_on_every_rank(lambda agree: save_tensors(_rank_dir(directory, 0), states, full, agree=agree,
                                                   fields=fields, numel=numel),
                        full, directory, 1, None)
    retire_single_directory(directory)
    return os.path.abspath(directory)


def save_store_states(directory: str, numels: Sequence[int], store: Any, buffers: List[Any],
                      meta: Dict[str, Any], before: Optional[Callable[[], Any]] = None) -> str:
    """A swap store holding the params' states end to end, streamed out as ``DIR/rank0/``."""
    save_shards_from_store(directory, store, buffers, layouts=[FlatLayout(numels)], meta=meta, before=before)
    retire_single_directory(directory)
    return os.path.abspath(directory)


def load_states(directory: str, numels: Sequence[int], scratch: Dict[str, List[Any]],
                fields: Sequence[StateField] = IN_PLACE_FIELDS) -> Dict[str, Any]:
    """Fill ``scratch`` (name -> one tensor per param, ``fields``) from checkpoint ``directory``; its meta.
    Filled as the data streams in: load into scratch tensors, then keep them."""
    if _single(directory):
        return load_tensors(directory, scratch)
    with reading_shards(directory):  # no save between the meta's check and the data ([Note: checkpoint lock])
        first, world = _flat_meta(directory, [[int(n) for n in numels]], fields)
        path = _rank_dir(directory, 0)
        if world != 1:
            raise ValueError(f"{directory}: a checkpoint of {world} ranks' shards; fp32 params updated in place "
                             "save one (rank0/)")
        _check_rank_meta(path, load_tensors(path, scratch, fields=fields), 0, 1, first)
    return first


def fill_store_states(directory: str, numels: Sequence[int], store: Any, buffers: List[Any],
                      fields: Sequence[StateField] = IN_PLACE_FIELDS) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """Stream checkpoint ``directory`` into the free slots of ``store`` (the params' states
    end to end); (meta, written) for its commit, nothing committed here."""
    if _single(directory):
        return load_store(store, buffers, directory)
    with reading_shards(directory):  # no save between the meta's check and the data ([Note: checkpoint lock])
        return fill_store_from_shards(directory, [FlatLayout(numels)], store, buffers, fields)
