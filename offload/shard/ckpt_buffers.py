"""The model's buffers in a stage 3 checkpoint (checkpoint.py [Note: stage 3 checkpoint]).

[Note: stage 3 checkpoint buffers] Each rank's file holds that rank's persistent buffers, the
ones ``module.state_dict()`` holds (BatchNorm's running stats and ``num_batches_tracked``; not
the non-persistent ones, rotary caches and masks, which the model rebuilds), and the manifest
their names and shapes. Ranks may differ in them (BatchNorm's stats follow each rank's batches),
so a load on as many ranks as saved gives each rank its own buffers back, exactly; on another
number of ranks every rank takes the old rank 0's, as ``full_state_dict`` keeps rank 0's. A
checkpoint saved before buffers were kept (its manifest names none) loads with a warning and
leaves the model's buffers as they are."""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

__all__ = ["persistent_buffers", "describe_buffers", "check_buffers", "buffers_from", "apply_buffers",
           "warn_without"]


def persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` holds, by their state dict names (a buffer shared by
    two modules under each name, as state_dict lists it)."""
    out: Dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        skip = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is not None and name not in skip:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def describe_buffers(bufs: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The manifest's record: each buffer's shape and dtype."""
    return {k: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", "")} for k, b in bufs.items()}


def check_buffers(m: Dict[str, Any], bufs: Dict[str, torch.Tensor], path: str) -> None:
    """ValueError naming the buffers that differ (missing on one side, another shape) when the
    checkpoint holds buffers; none to check in a checkpoint saved before they were kept. A
    dtype that differs is cast as ``load_state_dict`` casts it."""
    saved = m.get("buffers")
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: the manifest's buffers are malformed")
    problems = []
    only_saved = sorted(set(saved) - set(bufs))
    only_here = sorted(set(bufs) - set(saved))
    if only_saved:
        problems.append(f"buffers only in the checkpoint: {', '.join(map(repr, only_saved[:5]))}")
    if only_here:
        problems.append(f"buffers only in this model: {', '.join(map(repr, only_here[:5]))}")
    shapes = [k for k in bufs if k in saved and list(saved[k].get("shape", [])) != list(bufs[k].shape)]
    if shapes:
        k = shapes[0]
        problems.append(f"buffer {k!r} is {list(saved[k].get('shape', []))} in the checkpoint, "
                        f"{list(bufs[k].shape)} here" + (f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""))
    if problems:
        raise ValueError(f"{path}: the checkpoint is of another model: " + "; ".join(problems))


def buffers_from(m: Dict[str, Any], data: Dict[str, Any], path: str) -> Optional[Dict[str, torch.Tensor]]:
    """The buffers of one old rank's file (None for a checkpoint saved without buffers),
    checked against the manifest's names and shapes."""
    if m.get("buffers") is None:
        return None
    got = data.get("buffers")
    if not isinstance(got, dict) or set(got) != set(m["buffers"]) \
            or any(not isinstance(t, torch.Tensor) or list(t.shape) != list(m["buffers"][k]["shape"])
                   for k, t in got.items()):
        raise ValueError(f"{path}: its buffers are not the ones the manifest names")
    return got


def apply_buffers(bufs: Dict[str, torch.Tensor], loaded: Dict[str, torch.Tensor]) -> None:
    """Copy the loaded buffers into the model's (cast to their dtype, on their device)."""
    for k, b in bufs.items():
        b.copy_(loaded[k])


def warn_without(bufs: Dict[str, torch.Tensor], directory: str) -> None:
    """The warning for a checkpoint saved without buffers into a model that has some."""
    if bufs:
        warnings.warn(f"the stage 3 checkpoint in {directory} was saved without the model's buffers "
                      f"({len(bufs)}, e.g. {next(iter(bufs))!r}): they keep their current values", stacklevel=4)
