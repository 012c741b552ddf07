"""The checks SGD, Adagrad and Lion share with torch: its order, its messages, its exception types.

Each check runs before ``params`` is touched (as torch's constructors do); a value torch
would take but the kernels cannot honour (``differentiable=True``) is refused with the
reason, as ``options.check_hyper`` does for Adam.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from offload.optim.options import _check_lr, _check_scalar, check_torch_flags, refuse_differentiable

__all__ = ["check_nonneg", "check_lr", "check_flags", "check_flag_types", "torch_flags_off", "to_float"]


def check_lr(lr: Any) -> None:
    """torch's ``Invalid learning rate`` check (a 1-element tensor is accepted, as torch)."""
    _check_lr(lr, None, False)


def check_nonneg(name: str, value: Any, label: str, *, tensor_ok: bool = False) -> None:
    """``Invalid {label}: {value}`` (torch's words) for a negative or NaN ``value``;
    ``tensor_ok`` where torch's signature takes a Tensor too (SGD's weight_decay)."""
    _check_scalar(name, value, tensor_ok=tensor_ok)
    if not 0.0 <= value:
        raise ValueError(f"Invalid {label}: {value}")


def check_flags(cls_name: str, *, foreach: Optional[bool], differentiable: bool, fused: Optional[bool]) -> None:
    """torch's refusals of flag combinations (RuntimeError, its text), then ours."""
    check_torch_flags(foreach=foreach, differentiable=differentiable, fused=fused)
    if differentiable:
        refuse_differentiable(cls_name, cls_name)


def check_flag_types(defaults: Tuple[Tuple[str, Any], ...], group: Dict[str, Any]) -> None:
    """TypeError unless each flag of ``defaults`` (a class's GROUP_DEFAULTS) in ``group`` is a
    bool, or None where torch takes None (``foreach``, ``fused``). For a checkpoint's groups
    (``check_group``): a damaged ``amsgrad: [[-1]]`` loaded, then failed every step with a
    message about rules; torch's constructors never see such a value, so they do not check."""
    for key, default in defaults:
        v = group.get(key, default)
        none_ok = default is None or key in ("foreach", "fused")
        if not (isinstance(v, bool) or (none_ok and v is None)):
            raise TypeError(f"{key} must be True or False{' or None' if none_ok else ''}, got {type(v).__name__} "
                            f"{v!r:.80}")


def torch_flags_off(group: Dict[str, Any]) -> Dict[str, Any]:
    """``group`` with the flags that only pick torch's code path (``foreach``, ``fused``: None)
    and those a load clears with a warning (``capturable``, ``differentiable``: False,
    ``options.clear_execution_flags``) off: a group from outside (loaded, added) is checked
    for their type only (``check_flag_types``), so torch's dicts with ``foreach=True`` and a
    Tensor ``lr``, or ``differentiable=True``, still load (``check_group``)."""
    return dict(group, **{k: (None if k in ("foreach", "fused") else False)
                          for k in ("foreach", "fused", "capturable", "differentiable") if isinstance(group.get(k), bool)})


def to_float(group: Dict[str, Any], key: str) -> float:
    x = group[key]
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element")
        return float(x.item())
    return float(x)
