"""Which of a unit's params share a flat: those of one dtype, and of one key of ``split``.

[Note: split flats] A unit's params of one dtype become one flat shard, one tensor: one
param group of the optimizer, one ``lr`` and one ``weight_decay`` for all of them. Training
recipes decay the matrices and not the biases and norm weights (the Hugging Face
``Trainer``'s decay / no-decay groups, by name): with one flat the Trainer saw no bias
names, and every bias and norm weight decayed with the rest, silently. ``shard(model,
split=fn)`` keeps apart the params for which ``fn(name, param, module)`` (the param's name
in the model before ``shard()``, the param, the module holding it) gives different keys:
each (dtype, key) of a unit is a flat of its own, named ``_shard_<dtype>`` for the key
None and ``_shard_<dtype>_<key>`` for the others, so that they can go to different param
groups. ``split_no_decay`` is the Trainer's rule; its key ``"bias_and_norm"`` names the
flat so that the Trainer's own name patterns put it in the no-decay group. Each flat is
gathered and reduce-scattered on its own (one more collective per unit and key).
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["split_no_decay", "flat_groups", "check_split", "warn_no_decay_lost"]

SplitFn = Callable[[str, nn.Parameter, nn.Module], Optional[str]]
_KEY = re.compile(r"[A-Za-z0-9_]+\Z")
# transformers' Trainer.get_decay_parameter_names: these name patterns (lowercased), or a
# param of an nn.LayerNorm, take no weight decay
_NO_DECAY_NAMES = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                            r"_norm(?:$|\.)")]


def split_no_decay(name: str, param: nn.Parameter, module: nn.Module) -> Optional[str]:
    """``"bias_and_norm"`` for the params the Hugging Face Trainer gives no weight decay
    (biases, norm weights: by name, or any param of an ``nn.LayerNorm``); None for the rest."""
    if isinstance(module, nn.LayerNorm) or any(p.search(name.lower()) for p in _NO_DECAY_NAMES):
        return "bias_and_norm"
    return None


def check_split(split: Any) -> None:
    if split is not None and not callable(split):
        raise TypeError(f"split must be None or a callable (name, param, module) -> str or None, got {split!r}")


def _key(split: Optional[SplitFn], name: str, p: nn.Parameter, module: nn.Module) -> Optional[str]:
    if split is None:
        return None
    key = split(name, p, module)
    if key is not None and (not isinstance(key, str) or not _KEY.match(key)):
        raise ValueError(f"split({name!r}, ...) returned {key!r}: a key must be None or a non-empty str of "
                         "letters, digits and '_' (it names the flat: _shard_<dtype>_<key>)")
    return key


def flat_groups(ms: List[Tuple[nn.Parameter, List[Tuple[nn.Module, str]]]], qual: Dict[int, str],
                split: Optional[SplitFn]) -> List[Tuple[torch.dtype, str, List[int], List[str]]]:
    """A unit's members (param, its (module, name) holders) split into flats: (dtype, the
    shard's attribute name, their positions in ``ms``, their names before ``shard()``)."""
    groups: Dict[Tuple[torch.dtype, Optional[str]], List[int]] = {}
    for j, (p, owners) in enumerate(ms):
        groups.setdefault((p.dtype, _key(split, qual[id(p)], p, owners[0][0])), []).append(j)
    out = []
    for (dt, key), idx in groups.items():
        attr = f"_shard_{str(dt).replace('torch.', '')}" + ("" if key is None else f"_{key}")
        out.append((dt, attr, idx, [qual[id(ms[j][0])] for j in idx]))
    return out


def _holder(root: Optional[nn.Module], name: str) -> nn.Module:
    try:
        return root.get_submodule(name.rpartition(".")[0]) if root is not None else nn.Module()
    except AttributeError:
        return nn.Module()


def warn_no_decay_lost(units: List[Any], param_groups: List[Dict[str, Any]]) -> None:
    """[Note: an empty no-decay group] An optimizer over the shards whose groups include one
    with ``weight_decay`` 0 and no params, beside groups that decay shards holding biases or
    norm weights: the groups were made by name (the Hugging Face Trainer's ``create_optimizer``,
    or a loop over ``named_parameters()``), saw only the shards' names, and so every bias and
    norm weight decays, silently. Warned once, at the optimizer's construction, naming some."""
    if not any(not g["params"] and not g.get("weight_decay") for g in param_groups):
        return
    decayed = {id(p) for g in param_groups if g.get("weight_decay") for p in g["params"]}
    root = next((u.module for u in units if u.is_root), None)
    lost = [name for u in units for flat in u.flats if id(flat.shard) in decayed for name in flat.names
            if split_no_decay(name, flat.shard, _holder(root, name)) is not None]
    if lost:
        more = ", ..." if len(lost) > 3 else ""
        warnings.warn(
            f"offload.shard: the optimizer's param group with weight_decay=0 is empty, while {len(lost)} biases and "
            f"norm weights ({', '.join(lost[:3])}{more}) are in shards of a group that decays them: a unit's params "
            "of one dtype are one flat shard, so groups made by name (the Hugging Face Trainer's decay / no-decay "
            "groups) see only the shards' names. Shard with split=offload.shard.split_no_decay to keep them apart",
            UserWarning, stacklevel=2)
