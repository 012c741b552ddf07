"""The optimizer's ``param_groups`` hyperparameters in a checkpoint's meta, as torch's
``state_dict`` keeps them: every key of every group but ``params``, restored on load as
``load_state_dict`` does (same number of groups and of params per group, else an error and
nothing loaded).

The meta is JSON, so a value is written as itself when JSON holds it and otherwise tagged:
a tuple as ``{"tuple": [...]}`` (betas come back a tuple), a one-element Tensor (a Tensor
``lr``) as ``{"tensor": <its float value>, "dtype": ...}`` - its value as a Python float, so a
float64 tensor keeps every bit and a float32 one too. A value of no such kind (an object a
user put in a group) is not saved; its key is listed under ``skipped`` and keeps its current
value on load. A checkpoint without ``param_groups`` (the previous release's) restores none.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.swap.ckpt_dir import CKPT_MANIFEST, read_manifest

__all__ = ["encode_groups", "decode_groups", "saved_meta", "checkpoint_groups", "apply_groups"]

_NOT_SAVED = ("params", "param_names")  # the params themselves (and their names) are the optimizer's own


class _Unsaveable(Exception):
    pass


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}  # strict JSON has no inf/nan
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype.is_floating_point:
        return {"tensor": _encode(float(v.item())), "dtype": str(v.dtype).replace("torch.", ""), "dim": v.dim()}
    raise _Unsaveable(type(v).__name__)


def encode_groups(param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for group in param_groups:
        hyper: Dict[str, Any] = {}
        skipped: Dict[str, str] = {}
        for key, v in group.items():
            if key in _NOT_SAVED:
                continue
            try:
                hyper[key] = _encode(v)
            except _Unsaveable as exc:
                skipped[key] = str(exc)
        out.append({"n_params": len(group["params"]), "hyper": hyper, "skipped": skipped})
    return out


def _decode(v: Any, like: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x, None) for x in v]
    if not isinstance(v, dict):
        return v
    if "float" in v:
        return float(v["float"])
    if "tuple" in v:
        likes = like if isinstance(like, tuple) and len(like) == len(v["tuple"]) else (None,) * len(v["tuple"])
        return tuple(_decode(x, lk) for x, lk in zip(v["tuple"], likes))
    if "tensor" in v:
        dtype = getattr(torch, str(v.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {v.get('dtype')!r}")
        device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
        t = torch.tensor(_decode(v["tensor"], None), dtype=dtype, device=device)
        return t.reshape([1] * int(v.get("dim", 0)))
    raise ValueError(f"unknown value {v!r}")


def saved_meta(directory: str) -> Tuple[Dict[str, Any], str]:
    """(the meta, the manifest's path) of checkpoint ``directory``: rank 0's (every rank's
    holds the optimizer's own keys), or the previous release's single-directory one; an
    empty meta when there is no manifest (the load that follows says what is missing)."""
    where = os.path.join(directory, "rank0")
    if not os.path.lexists(os.path.join(where, CKPT_MANIFEST)):
        where = directory
    path = os.path.join(where, CKPT_MANIFEST)
    if not os.path.lexists(path):
        return {}, path
    return read_manifest(where).get("meta") or {}, path


def checkpoint_groups(directory: str, param_groups: List[Dict[str, Any]], *, shards: bool = True,
                      check: Optional[Callable[[Dict[str, Any]], None]] = None) -> Optional[List[Dict[str, Any]]]:
    """The hyperparameters of checkpoint ``directory`` (in ``rank0/``; or, for the previous
    release's single-directory format, in ``directory``: ``shards`` is no longer needed to
    tell), decoded and checked against ``param_groups``; None when it has none (or no
    manifest: the load that follows says what is missing). Raises ValueError on a mismatch."""
    meta, path = saved_meta(directory)
    saved = meta.get("param_groups")
    if saved is None:
        return None
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("hyper"), dict)
                                              and isinstance(g.get("n_params"), int) for g in saved):
        raise ValueError(f"{path}: meta.param_groups is not a list of groups")
    ours = sum(len(g["params"]) for g in param_groups)
    if sum(g.get("n_params") or 0 for g in saved) != ours:
        steps = meta.get("steps")
        if isinstance(steps, list) and len(steps) == ours:  # the store would load it, its groups not
            raise ValueError(f"{path}: meta.param_groups counts {[g.get('n_params') for g in saved]!r:.80} params, "
                             f"its step counts {ours}; nothing was loaded")
        return None  # a checkpoint of other params: the store's load refuses it, saying so
    return decode_groups(saved, param_groups, path, check)


def decode_groups(saved: Any, param_groups: List[Dict[str, Any]], path: str,
                  check: Optional[Callable[[Dict[str, Any]], None]] = None) -> List[Dict[str, Any]]:
    """``encode_groups``' list ``saved`` decoded, each group's hyperparameters checked against
    ``param_groups`` (as many groups, as many params in each) and, each group as it would be
    after the load, by ``check`` (the optimizer's ``check_group``: its constructor's checks;
    a damaged ``lr: "x"`` loaded, then failed every step); ValueError naming ``path``."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("hyper"), dict)
                                              and isinstance(g.get("n_params"), int) for g in saved):
        raise ValueError(f"{path}: param_groups is not a list of groups")
    if len(saved) != len(param_groups):
        raise ValueError(f"{path}: the checkpoint has {len(saved)} param groups, this optimizer {len(param_groups)}; "
                         "nothing was loaded")
    out = []
    for i, (g, cur) in enumerate(zip(saved, param_groups)):
        if g.get("n_params") != len(cur["params"]):
            raise ValueError(f"{path}: param group {i} has {g.get('n_params')} params in the checkpoint, "
                             f"{len(cur['params'])} in this optimizer; nothing was loaded")
        try:
            hyper = {k: _decode(v, cur.get(k)) for k, v in g["hyper"].items()}
            if check is not None:
                check(dict(cur, **hyper))
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            raise ValueError(f"{path}: param group {i}: {exc}; nothing was loaded") from None
        out.append(hyper)
    return out


def apply_groups(param_groups: List[Dict[str, Any]], saved: List[Dict[str, Any]]) -> None:
    """Every saved key replaces the group's (as torch's load_state_dict); others stay."""
    for group, hyper in zip(param_groups, saved):
        group.update(hyper)
