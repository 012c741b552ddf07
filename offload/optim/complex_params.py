"""complex64 params, stepped as torch's optimizers step them.

[Note: complex params] torch's Adam, AdamW, Adagrad and SGD update a complex param through
``torch.view_as_real``: the param, its grad and each state as float32 (real, imaginary)
pairs, every element by the real rule, and the states kept complex in ``opt.state`` (a
state dict holds complex ``exp_avg``...). The host store does the same: the kernels see the
real views (the same memory, 2x the elements), ``opt.state`` keeps torch's complex tensors,
and checkpoints hold the real views' float32 values. So the results are torch's element by
element, within the numerics contract of float32 params.

Only the host store takes them (``offload="none"`` or ``"cpu"``, stage 0, CPU params): the
flat and swapped stores lay out an fp32 master per element, which would have to carry the
pairs through partitioning, swap files and device copies; refused there with a message.
Lion is refused too: its update is ``sign(...)``, which torch defines for real numbers only
(``torch.sign`` refuses complex; lion-pytorch takes none).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from offload.memory import paging

__all__ = ["COMPLEX_DTYPES", "COMPLEX_RULE_CLASSES", "real_view", "real_numel", "as_param_layout", "fill_value",
           "host_params"]

COMPLEX_DTYPES = (torch.complex64,)
"""The complex dtypes stepped (as float32 pairs); complex128 would need float64 arithmetic."""

COMPLEX_RULE_CLASSES = ("Adam/AdamW", "SGD", "Adagrad")
"""Optimizers (their ``TORCH_NAME``) whose torch counterpart steps complex params by real views."""


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a complex ``t``'s float32 (..., 2) view of the same memory."""
    return torch.view_as_real(t) if t.is_complex() else t


def real_numel(p: torch.Tensor) -> int:
    """Elements the kernels step for ``p``: twice a complex param's."""
    return p.numel() * (2 if p.is_complex() else 1)


def fill_value(p: torch.Tensor, value: float) -> Any:
    """What ``torch.full_like(p, .)`` takes for a state whose every float32 starts at
    ``value``: ``complex(value, value)`` for a complex param (torch's Adagrad fills its sum so)."""
    return complex(value, value) if p.is_complex() else value


def as_param_layout(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float32 values (``real_numel(p)`` of them) in ``p``'s layout: complex of p's shape for
    a complex param (the same memory), else p's shape."""
    if p.is_complex():
        return torch.view_as_complex(flat.view(*p.shape, 2))
    return flat.view(p.shape)


def host_params(params: Sequence[torch.Tensor], *, stage: int, offload: str, cls_name: str) -> bool:
    """Whether every param can be stepped in place by the host store (fp32 or complex64 CPU
    params, not paged); complex params where the host store will not be the one (another
    offload or stage, device params) are refused, naming the first."""
    host = all(p.device.type == "cpu" and p.dtype in (torch.float32,) + COMPLEX_DTYPES and not paging.paged(p)
               for p in params)
    if host and stage == 0 and offload in ("none", "cpu"):
        return True
    first = next((i for i, p in enumerate(params) if p.is_complex()), None)
    if first is not None:
        theirs = "AdamW (or Adam)" if cls_name == "Adam/AdamW" else cls_name
        raise NotImplementedError(
            f"offload.{cls_name}: parameter {first} is {params[first].dtype} on {params[first].device}: complex "
            f"params are stepped only by the host store (offload='none' or 'cpu', stage 0, every param a "
            f"float32 or complex64 CPU tensor), got offload={offload!r}, stage {stage}: use those settings, or "
            f"torch.optim.{theirs}")
    return host
