"""Sparse COO grads (``nn.Embedding(sparse=True)``) for the optimizers torch steps them with.

[Note: sparse grads] torch's SGD and Adagrad step a param whose ``.grad`` is a sparse COO
tensor; Adam, AdamW and Lion refuse it (``SPARSE_MESSAGE``, torch's words for Adam). The
kernels read dense grads only, so a sparse grad is stepped as its dense equivalent: a buffer
the size of the param (alive for the step), zero except at the grad's coalesced indices
(duplicates summed, as torch's ``coalesce()``). Everything after this sees that dense grad:
``max_grad_norm`` takes its norm, GradScaler's 1/scale multiplies it in the kernel. That is
torch's result element by element (within rounding where the grad names an element: torch's
sparse ops compute ``-clr * (g / std)`` and sum buffers in another order):

- Where the grad names nothing, a zero grad leaves Adagrad's sum (``sum + 0*0``) and param
  (``p + (-clr) * 0 / std``), and SGD's param (``p - lr * 0``), bit for bit, as torch's sparse
  ops (only the grad's indices) do. Two exceptions, handled: ``maximize``, where the kernel's
  ``-g`` of a +0.0 is -0.0 and ``-lr * -0.0`` would turn a -0.0 param into +0.0 (the buffer is
  filled with -0.0 then, which the kernel negates into the +0.0 of the plain case); and
  Adagrad's ``eps == 0`` over a sum of 0 (0/0 = NaN where torch leaves the param), refused
  when ``initial_accumulator_value == 0`` (a positive one keeps every sum positive).
- torch's refusals, in its words and types: Adagrad's ``weight_decay != 0``; SGD's
  ``weight_decay != 0`` (its ``grad.add(param)``: "add(sparse, dense) is not supported");
  ``fused=True`` for both. ``foreach=True`` steps them (torch falls back to a loop).
- SGD's momentum buffer stays sparse in torch's state; ours is dense (the same values):
  torch loads our ``state_dict`` and goes on with it dense; SGD.load_state_dict densifies
  torch's.

CPU params at stage 0 only (``offload`` "none", "cpu", "nvme"; fp32 params read it in place,
fp16/bf16 ones through the flat store's copy, as a dense grad); stages 1-3 and device params
are refused before anything changes. Nothing here runs for a dense grad: the step calls it
only for ``g.is_sparse``, the check it made before sparse grads were stepped.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["dense_grad"]


def dense_grad(opt: Any, group: Dict[str, Any], p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The dense equivalent of the sparse COO grad ``g`` of ``p`` (see the note), or the
    refusal torch (or this store) gives for it."""
    check_sparse_grad(opt, group, p, g)
    g = g.coalesce()
    # -0.0 under maximize: the kernel's -g is then +0.0 where the grad names nothing (the note)
    dense = torch.full(p.shape, -0.0 if group.get("maximize", False) else 0.0, dtype=p.dtype)
    if g._nnz():
        dense[tuple(g._indices())] = g._values()  # coalesced: each index once, its summed value
    return dense


def check_sparse_grad(opt: Any, group: Dict[str, Any], p: torch.Tensor, g: torch.Tensor) -> None:
    """The refusal torch (or this store) gives for the sparse grad ``g`` of ``p``, if any (also
    before the ranks agree to begin a step: step_agreement.check_local_grads)."""
    if not getattr(opt, "SPARSE_GRADS", False):
        raise RuntimeError(opt.SPARSE_MESSAGE)
    _check_torch_refusals(opt, group)
    if g.dtype != p.dtype or tuple(g.shape) != tuple(p.shape) or g.device != p.device:
        raise TypeError(f"a sparse grad of {str(g.dtype).replace('torch.', '')} {list(g.shape)} on {g.device} for a "
                        f"param of {str(p.dtype).replace('torch.', '')} {list(p.shape)} on {p.device}; a grad must "
                        "match its param's dtype, shape and device")
    if not p.is_cpu or getattr(opt, "stage", 0) != 0 or getattr(p, "_offload_shard", None) is not None:
        raise RuntimeError(f"offload.{opt.TORCH_NAME}: sparse grads are stepped for CPU params at stage 0 only "
                           f"(offload='none', 'cpu' or 'nvme'); this param is on {p.device} at stage "
                           f"{getattr(opt, 'stage', 0)}: use dense grads (nn.Embedding(sparse=False))")


def _check_torch_refusals(opt: Any, group: Dict[str, Any]) -> None:
    """torch's refusals of a sparse grad, in its words and types."""
    if opt.TORCH_NAME == "Adagrad":
        if group["weight_decay"] != 0:
            raise RuntimeError("weight_decay option is not compatible with sparse gradients")
        if group.get("fused"):
            raise RuntimeError("`fused` does not support sparse grad or complex param")
        if group["eps"] == 0 and opt.defaults["initial_accumulator_value"] == 0:
            raise RuntimeError("offload.Adagrad: eps=0 and initial_accumulator_value=0 with a sparse grad: the "
                               "dense step would give 0/0 (NaN) at the elements the grad does not name while "
                               "their sum is 0, where torch leaves them; use eps > 0 or a positive "
                               "initial_accumulator_value")
    elif opt.TORCH_NAME == "SGD":
        if group.get("fused"):
            raise RuntimeError("`_fused_sgd` does not support sparse gradients")
        if group["weight_decay"] != 0:  # torch's grad.add(param, alpha=weight_decay), sparse + dense
            raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
