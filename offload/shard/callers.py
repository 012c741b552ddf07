"""Whose call a sharded model's ``state_dict()`` runs under, where the caller would take this
rank's shards for something they are not: DCP's getters with ``full_state_dict=True`` ([Note:
DCP's full_state_dict on shards] in dcp_chunks.py) and accelerate's ``get_state_dict`` /
``save_model`` ([Note: accelerate's get_state_dict on shards]). Found by walking the frames
above the hook (as guards.py finds FSDP's module walk): these libraries pass nothing down to
``state_dict()`` that says what the dict is for. ``caller()`` also finds torch's
ZeroRedundancyOptimizer building an offload optimizer (offload/zero/wrapped.py).

[Note: accelerate's get_state_dict on shards] ``Accelerator.get_state_dict(model)``, which
``save_model`` calls, gathers a model only where accelerate itself sharded it (DeepSpeed ZeRO-3,
FSDP); for any other model it takes ``model.state_dict()``. Of a model ``offload.shard`` sharded
that is this rank's shards under the units' names: ``save_model`` wrote them as the model's
weights (on several ranks, rank 0's half), a file no unsharded model loads. It raises instead,
pointing at ``offload.shard.full_state_dict`` (the whole weights by their names, a collective)
and ``save_pretrained`` (which a transformers model's sharding makes write the whole weights).
A raise, not a gather: ``save_model`` is often called on the main process only, where a
collective would hang.
"""
from __future__ import annotations

import sys
from types import FrameType
from typing import FrozenSet, Optional

__all__ = ["caller", "check_not_gathered", "check_not_accelerate"]

_DCP = "torch.distributed.checkpoint.state_dict"
_DCP_GETTERS = frozenset({"_get_model_state_dict", "_get_optim_state_dict"})


def caller(names: FrozenSet[str], module: str, start: int = 2, limit: int = 256) -> Optional[FrameType]:
    """The nearest frame above (from ``start`` frames up) of a function named one of ``names``
    in ``module``; None within ``limit`` frames (the module tree's recursion, torch's wrappers)."""
    try:
        frame: Optional[FrameType] = sys._getframe(start)
    except ValueError:  # (no Python frame that far up)
        return None
    for _ in range(limit):
        if frame is None:
            return None
        if frame.f_code.co_name in names and frame.f_globals.get("__name__") == module:
            return frame
        frame = frame.f_back
    return None


def check_not_gathered(world: int) -> None:
    """[Note: DCP's full_state_dict on shards]: a RuntimeError where DCP would take this
    rank's chunk (of ``world`` ranks' shards) for the whole tensor."""
    if world <= 1:
        return
    frame = caller(_DCP_GETTERS, _DCP)
    if frame is not None and getattr(frame.f_locals.get("info"), "full_state_dict", False):
        raise RuntimeError(
            f"torch.distributed.checkpoint's full_state_dict=True gathers DTensors only: on a model offload.shard "
            f"sharded over {world} ranks it would return this rank's chunk of each unit (and of its optimizer "
            "states) as the whole. Save the whole weights with offload.shard.full_state_dict(model, path) (a "
            "collective), or keep full_state_dict=False: dcp.save and dcp.load then save and load every rank's "
            "chunk, at any world size")


def check_not_accelerate() -> None:
    """[Note: accelerate's get_state_dict on shards]."""
    if caller(frozenset({"get_state_dict"}), "accelerate.accelerator") is not None:
        raise RuntimeError(
            "accelerate's get_state_dict / save_model of a model offload.shard sharded would give this rank's "
            "shards under the units' names, not the model's weights: save them with "
            "offload.shard.full_state_dict(model, path) (a collective: call it on every rank; rank 0 writes the "
            "file), or model.save_pretrained(...) for a transformers model")
