"""Params the float32 kernels do not take as they are: complex64 and float64, stepped by the
host store as torch's optimizers step them.

[Note: complex params] torch's Adam, AdamW, Adagrad and SGD update a complex param through
``torch.view_as_real``: the param, its grad and each state as float32 (real, imaginary)
pairs, every element by the real rule, and the states kept complex in ``opt.state`` (a
state dict holds complex ``exp_avg``...). The host store does the same: the kernels see the
real views (the same memory, 2x the elements), ``opt.state`` keeps torch's complex tensors,
and checkpoints hold the real views' float32 values. So the results are torch's element by
element, within the numerics contract of float32 params. Lion is refused: its update is
``sign(...)``, which torch defines for real numbers only (``torch.sign`` refuses complex;
lion-pytorch takes none).

[Note: float64 params] The native and numba kernels compute in float32. A float64 param is
stepped by the torch backend's arithmetic (torch's single-tensor statements, op for op) in
float64, its states float64 in ``opt.state`` as torch keeps them: torch's results, at
torch's speed, with no SIMD kernel. ``save_checkpoint`` / ``load_checkpoint`` refuse them
(the streamed format holds float32 states: ``state_dict()`` keeps every bit).

Only the host store takes either (``offload="none"`` or ``"cpu"``, stage 0, CPU params): the
flat and swapped stores lay out an fp32 master per element, which would have to carry pairs
or doubles through partitioning, swap files and device copies; refused there with a message.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from offload.memory import paging

__all__ = ["COMPLEX_DTYPES", "COMPLEX_RULE_CLASSES", "HOST_ONLY_DTYPES", "real_view", "real_numel",
           "as_param_layout", "fill_value", "state_dtype_of", "host_params", "float64_step", "refuse_float64"]

COMPLEX_DTYPES = (torch.complex64,)
"""The complex dtypes stepped (as float32 pairs); complex128 would need float64 pairs."""

COMPLEX_RULE_CLASSES = ("Adam/AdamW", "SGD", "Adagrad")
"""Optimizers (their ``TORCH_NAME``) whose torch counterpart steps complex params by real views."""

HOST_ONLY_DTYPES = (torch.float64,) + COMPLEX_DTYPES
"""Param dtypes only the host store steps."""


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a complex ``t``'s float32 (..., 2) view of the same memory."""
    return torch.view_as_real(t) if t.is_complex() else t


def real_numel(p: torch.Tensor) -> int:
    """Elements the kernels step for ``p``: twice a complex param's."""
    return p.numel() * (2 if p.is_complex() else 1)


def fill_value(p: torch.Tensor, value: float) -> Any:
    """What ``torch.full_like(p, .)`` takes for a state whose every real element starts at
    ``value``: ``complex(value, value)`` for a complex param (torch's Adagrad fills its sum so)."""
    return complex(value, value) if p.is_complex() else value


def state_dtype_of(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s states in torch's layout: complex64 or float64 as the param, else
    float32 (the stores' fp32 states, also for fp16/bf16 params)."""
    return p.dtype if p.dtype in HOST_ONLY_DTYPES else torch.float32


def as_param_layout(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float32 values (``real_numel(p)`` of them) in ``p``'s layout: complex of p's shape for
    a complex param (the same memory), else p's shape."""
    if p.is_complex():
        return torch.view_as_complex(flat.view(*p.shape, 2))
    return flat.view(p.shape)


def host_params(params: Sequence[torch.Tensor], *, stage: int, offload: str, cls_name: str) -> bool:
    """Whether every param can be stepped in place by the host store (fp32, float64 or
    complex64 CPU params, not paged); float64 and complex params where the host store will
    not be the one (another offload or stage, device or fp16/bf16 params beside them) are
    refused, naming the first."""
    # (a param on the meta device, where nothing copies it now: [Note: params on the meta
    # device] in step_guard.py; the other stores copy the params when built, and refuse it)
    lazy = ("cpu", "meta") if stage == 0 and offload in ("none", "cpu") else ("cpu",)
    host = all(p.device.type in lazy and p.dtype in (torch.float32,) + HOST_ONLY_DTYPES and not paging.paged(p)
               for p in params)
    if host and stage == 0 and offload in ("none", "cpu"):
        return True
    first = next((i for i, p in enumerate(params) if p.dtype in HOST_ONLY_DTYPES), None)
    if first is not None:
        theirs = "AdamW (or Adam)" if cls_name == "Adam/AdamW" else cls_name
        raise NotImplementedError(
            f"offload.{cls_name}: parameter {first} is {params[first].dtype} on {params[first].device}: float64 and "
            f"complex64 params are stepped only by the host store (offload='none' or 'cpu', stage 0, every param a "
            f"float32, float64 or complex64 CPU tensor), got offload={offload!r}, stage {stage}: use those "
            f"settings{'' if cls_name == 'Lion' else f', or torch.optim.{theirs}'}")
    return host


def float64_step(rule: Any, hyper: Any, params: List[torch.Tensor], grads: List[torch.Tensor],
                 states: List[Tuple[torch.Tensor, ...]], steps: List[int]) -> None:
    """One step of ``rule`` (``hyper``: its ``RuleHyper``) on float64 params, grads and
    states, in float64 ([Note: float64 params]); a strided tensor through a contiguous copy."""
    from offload.kernels import get_backend

    kernel = get_backend("torch")
    for p, g, sts, step in zip(params, grads, states, steps):
        flat = [t.view(-1) if t.is_contiguous() else t.contiguous().view(-1) for t in (p, g) + tuple(sts)]
        kernel.float64_step(rule, flat[0], flat[1], flat[2:], **hyper.kernel_kwargs(int(step)))
        for orig, tmp in zip((p,) + tuple(sts), (flat[0],) + tuple(flat[2:])):
            if orig.numel() and orig.data_ptr() != tmp.data_ptr():
                orig.copy_(tmp.view_as(orig))


def refuse_float64(params: Sequence[torch.Tensor], what: str) -> None:
    """``save_checkpoint`` / ``load_checkpoint`` with float64 params: the streamed format
    holds float32 states, which would round theirs."""
    first = next((i for i, p in enumerate(params) if p.dtype == torch.float64), None)
    if first is not None:
        raise NotImplementedError(f"{what}: parameter {first} is float64, whose states the checkpoint format "
                                  "(float32) would round: save opt.state_dict() instead (torch.save keeps every bit)")
