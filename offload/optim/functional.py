"""Functional Adam/AdamW over lists of tensors: the core the optimizer classes call.

Mirrors ``torch.optim.adam.adam``: the class validates and keeps state, this function
picks the implementation (``offload.kernels`` backend: native, numba or torch) and runs one
fused pass per tensor. Step numbers come in as arguments; nothing is cached between calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from offload.kernels import get_backend
from offload.kernels._checks import check_adam_args, check_grad_scale
from offload.kernels.fields import ADAM

__all__ = ["AdamHyper", "adam_step"]


@dataclass(frozen=True)
class AdamHyper:
    """The hyperparameters of one param group for one step, as the kernels take them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool = False
    bias_correction: bool = True
    grad_scale: float = 1.0
    """Multiplier applied to every grad inside the pass (1/loss-scale times clip coefficient)."""

    def kernel_kwargs(self, step: int) -> dict:
        return dict(
            lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, step=step, decoupled=self.decoupled,
            bias_correction=self.bias_correction, maximize=self.maximize,
            grad_scale=self.grad_scale,
        )


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    hyper: AdamHyper,
    *,
    params_lowp: Optional[Sequence[Optional[torch.Tensor]]] = None,
    backend: Optional[str] = None,
    num_threads: Optional[int] = None,
) -> None:
    """One Adam/AdamW step on each ``(param, grad, exp_avg, exp_avg_sq, step)``, in place.

    ``params`` and the moments are fp32 CPU tensors; ``grads`` fp32, fp16 or bf16 of the same
    shapes. Non-contiguous tensors are updated through a contiguous copy (correct, slower).
    ``steps`` are the step numbers *after* incrementing (1 on the first step).
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError(
            f"adam_step: list lengths differ: params {n}, grads {len(grads)}, exp_avgs "
            f"{len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, steps {len(steps)}"
        )
    if params_lowp is not None and len(params_lowp) != n:
        raise ValueError(f"adam_step: list lengths differ: params {n}, params_lowp {len(params_lowp)}")
    kernel = get_backend(backend)
    _check_all(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, params_lowp, num_threads)
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        if p.numel() == 0:
            continue
        lowp = params_lowp[i] if params_lowp is not None else None
        flat = [_flat(t) for t in (p, g, m, v)]
        flat_lowp = _flat(lowp) if lowp is not None else None
        kernel.rule_step(
            ADAM, flat[0], flat[1], {"exp_avg": flat[2], "exp_avg_sq": flat[3]},
            param_lowp=flat_lowp, num_threads=num_threads, **hyper.kernel_kwargs(int(steps[i])),
        )
        # A non-contiguous tensor was updated through a copy: write it back.
        for orig, tmp in ((p, flat[0]), (m, flat[2]), (v, flat[3])):
            if not _shares_storage(orig, tmp):
                orig.copy_(tmp.view_as(orig))
        if lowp is not None and not _shares_storage(lowp, flat_lowp):
            lowp.copy_(flat_lowp.view_as(lowp))


def _check_all(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, params_lowp, num_threads) -> None:
    """Every tensor and the scale, before the first is updated: a bad second tensor must not
    leave the first one stepped (the kernels check again, per call, at the pointer level)."""
    check_grad_scale(hyper.grad_scale)
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        lowp = params_lowp[i] if params_lowp is not None else None
        try:
            check_adam_args(p, g, m, v, lowp, step, num_threads, contiguous=False)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"adam_step: tensor {i}: {exc}") from None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or a.data_ptr() == b.data_ptr()
