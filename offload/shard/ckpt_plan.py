"""The checks and the arithmetic of stage 3 checkpoints (checkpoint.py [Note: stage 3
checkpoint]): what the manifest says of the model and the optimizer against what this
process has, and which pieces of the old ranks' chunks make a new rank's chunk."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["describe_flats", "check_model", "check_optimizer", "optimizer_entries", "group_of", "overlaps",
           "element_keys", "scalar_of", "rebuild_scalar"]

_SHOW = 5  # differences named in a message


def describe_flats(flats: List[Tuple[str, Any]]) -> List[Dict[str, Any]]:
    """Each unit flat as the manifest keeps it: unit, dtype, padded, chunk, its params."""
    return [{"unit": unit, "dtype": str(f.dtype).replace("torch.", ""), "padded": f.padded, "chunk": f.chunk,
             "params": [[n, list(s), o, k] for n, s, (o, k) in zip(f.names, f.shapes, f.slots)]}
            for unit, f in flats]


def _params_of(desc: List[Dict[str, Any]]) -> Dict[str, Tuple[str, List[int]]]:
    return {p[0]: (d["dtype"], list(p[1])) for d in desc for p in d["params"]}


def _listed(names: List[str]) -> str:
    return ", ".join(repr(n) for n in names[:_SHOW]) + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def check_model(m: Dict[str, Any], flats: List[Tuple[str, Any]], path: str) -> None:
    """ValueError naming the params that differ (missing on one side, another shape or
    dtype), or saying the units differ, when the checkpoint is of another model."""
    saved, here = m["flats"], describe_flats(flats)
    a, b = _params_of(saved), _params_of(here)
    problems = []
    only_saved = [n for n in a if n not in b]
    only_here = [n for n in b if n not in a]
    if only_saved:
        problems.append(f"params only in the checkpoint: {_listed(only_saved)}")
    if only_here:
        problems.append(f"params only in this model: {_listed(only_here)}")
    changed = [f"{n!r} ({a[n][0]} {a[n][1]} in the checkpoint, {b[n][0]} {b[n][1]} here)"
               for n in a if n in b and a[n] != b[n]]
    if changed:
        problems.append("params of another shape or dtype: " + ", ".join(changed[:_SHOW])
                        + (f" and {len(changed) - _SHOW} more" if len(changed) > _SHOW else ""))
    if problems:
        raise ValueError(f"{path}: the checkpoint is of another model: " + "; ".join(problems))
    layout = [(d["unit"], d["dtype"], [(p[0], p[2], p[3]) for p in d["params"]]) for d in saved]
    if layout != [(d["unit"], d["dtype"], [(p[0], p[2], p[3]) for p in d["params"]]) for d in here]:
        units = [d["unit"] or "<root>" for d in saved]
        raise ValueError(f"{path}: the checkpoint has the same params in other fetch units or flats ({_listed(units)}) "
                         "than this model: shard it with the same unit= and split= as the model that was saved")


def group_of(optimizer: Any, shard: torch.Tensor) -> Optional[int]:
    for gi, g in enumerate(optimizer.param_groups):
        if any(p is shard for p in g["params"]):
            return gi
    return None


def check_optimizer(m: Dict[str, Any], optimizer: Any, flats: List[Tuple[str, Any]], path: str) -> None:
    """ValueError when ``optimizer`` is not the saved one's kind: another class, other
    state names, the flats in other param groups (None, the params only: always fine)."""
    if optimizer is None:
        return
    saved = m.get("optimizer")
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: the checkpoint holds no optimizer states (saved with optimizer=None); "
                         "load it with optimizer=None")
    if saved.get("class") != type(optimizer).__name__:
        raise ValueError(f"{path}: the checkpoint's optimizer is {saved.get('class')}, this one "
                         f"{type(optimizer).__name__}")
    names = getattr(optimizer, "state_names", None)
    mine = list(names()) if names is not None else None
    if saved.get("state_names") != mine:
        raise ValueError(f"{path}: the checkpoint's optimizer keeps the states {saved.get('state_names')}, this one "
                         f"{mine}")
    moved = [f"{f.names[0]!r} (group {d.get('group')} in the checkpoint, {group_of(optimizer, f.shard)} here)"
             for d, (_, f) in zip(m["flats"], flats) if d.get("group") != group_of(optimizer, f.shard)]
    if moved:
        raise ValueError(f"{path}: the optimizer's param groups hold the shards otherwise than the saved one's: "
                         + ", ".join(moved[:_SHOW]))


def optimizer_entries(optimizer: Any, flats: List[Any]) -> List[Optional[Dict[str, Any]]]:
    """The ``state_dict()`` entry of each flat's shard param (None: no state yet), in torch's
    layout; ValueError when the optimizer does not hold every shard, or holds state of a param
    that is not one (a stage 3 optimizer steps the shards only)."""
    if optimizer is None:
        return [None] * len(flats)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    missing = [f.names[0] for f in flats if id(f.shard) not in index]
    if missing:
        raise ValueError(f"the optimizer does not hold the shards of the unit flats of {_listed(missing)}: "
                         "build it on model.parameters() after offload.shard()")
    sd = optimizer.state_dict()
    ours = {index[id(f.shard)] for f in flats}
    stray = [k for k, v in sd["state"].items() if k not in ours and v]
    if stray:
        raise ValueError(f"the optimizer holds states of params {stray[:_SHOW]} that are not shards of this model")
    out = []
    for f in flats:
        e = sd["state"].get(index[id(f.shard)])
        if e:
            for k, v in e.items():
                if k not in element_keys(e, f.chunk):
                    scalar_of(v, k)  # the ValueError of a state neither per element nor a number
        out.append(dict(e) if e else None)
    return out


def element_keys(entry: Dict[str, Any], chunk: int) -> List[str]:
    """The entry's states of one value per element of the shard (the moments, a master)."""
    return [k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == chunk]


def scalar_of(v: Any, key: str = "") -> Any:
    """A per-param scalar (``step``) as the manifest keeps it (JSON)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return {"tensor": float(v.item()), "dtype": str(v.dtype).replace("torch.", ""), "dim": v.dim()}
    if isinstance(v, (bool, int, float)):
        return v
    raise ValueError(f"optimizer state {key!r} is {type(v).__name__} {getattr(v, 'shape', '')}: neither one value per "
                     "element of its shard nor a number; a stage 3 checkpoint cannot reshard it")


def rebuild_scalar(v: Any) -> Any:
    if isinstance(v, dict):
        dtype = getattr(torch, str(v.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {v.get('dtype')!r} of a saved scalar")
        return torch.tensor(v["tensor"], dtype=dtype).reshape([1] * int(v.get("dim", 0)))
    return v


def overlaps(old_chunk: int, old_world: int, chunk: int, rank: int) -> List[Tuple[int, int, int, int]]:
    """(old rank, start, end in its chunk, offset in the new chunk) of every old chunk that
    overlaps ``rank``'s new one in the flat's element space (past the old ranks' end:
    padding, zeros, read from nobody)."""
    a, b = rank * chunk, (rank + 1) * chunk
    out = []
    for q in range(old_world):
        qa = q * old_chunk
        s, e = max(a, qa), min(b, qa + old_chunk)
        if s < e:
            out.append((q, s - qa, e - qa, s - a))
    return out
