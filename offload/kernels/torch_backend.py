"""The pure-torch reference backend: torch.optim.Adam/AdamW (foreach=False) math, op by op.

It is the last resort when neither the native library nor numba is available, and the
reference the tests hold the other backends to. It follows ``_single_tensor_adam`` in
torch/optim/adam.py statement for statement (same scalar types, same operation order).
It runs on torch's own intra-op pool: ``num_threads`` is validated but torch's pool size
(``torch.set_num_threads``) governs it, because resizing a process-wide pool per call is
not thread-safe.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from ._checks import check_tensor, check_threads, GRAD_DTYPES
from ._rule_step import _KERNELS, RuleStepFace, _bind
from .fields import Rule
from .compressed_ref import compose_step

__all__ = ["TorchBackend"]

_CHUNK = 1 << 20  # elements upcast to double at a time by grad_sumsq


class TorchBackend(RuleStepFace):
    name = "torch"

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, states: Tuple[torch.Tensor, ...],
              param_lowp: Optional[torch.Tensor], num_threads: Optional[int], hyper: tuple) -> None:
        # the hyperparameters as given: torch rounds its own Python scalars (no fold_adam)
        lr, beta1, beta2, eps, weight_decay, step, decoupled, bias_correction, maximize, \
            grad_scale = hyper
        exp_avg, exp_avg_sq = states[:2]
        p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
        g = grad.view(-1).to(p.dtype)  # float32 (float64 for a float64 param: float64_step)
        if grad_scale != 1.0:
            g = g * grad_scale
        if maximize:
            g = -g
        if weight_decay != 0:
            if decoupled:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if bias_correction:
            step = float(step)
            bc1 = 1 - beta1 ** step
            bc2 = 1 - beta2 ** step
        else:
            bc1 = bc2 = 1.0
        step_size = lr / bc1
        if len(states) == 3:  # amsgrad: the running maximum in the denominator
            vmax = states[2].view(-1)
            torch.maximum(vmax, v, out=vmax)
            v = vmax
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if param_lowp is not None:
            param_lowp.view(-1).copy_(p)

    def _adam_amsgrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        """torch's _single_tensor_adam with amsgrad=True."""
        self._adam(param, grad, states, param_lowp, num_threads, hyper)

    def _sgd(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        """torch's _single_tensor_sgd; the first step's buffer is a copy of d_p."""
        lr, momentum, dampening, weight_decay, nesterov, maximize, grad_scale, step = hyper
        p = param.view(-1)
        g = _scaled_grad(grad, grad_scale, maximize, p.dtype)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = states[0].view(-1)
            if step == 1:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)
        _copy_lowp(p, param_lowp)

    def _adagrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        """torch's _single_tensor_adagrad (dense, real)."""
        lr, lr_decay, weight_decay, eps, maximize, grad_scale, step = hyper
        p, state_sum = param.view(-1), states[0].view(-1)
        g = _scaled_grad(grad, grad_scale, maximize, p.dtype)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        clr = lr / (1 + (float(step) - 1) * lr_decay)  # torch's step is a float tensor
        state_sum.addcmul_(g, g, value=1)
        std = state_sum.sqrt().add_(eps)
        p.addcdiv_(g, std, value=-clr)
        _copy_lowp(p, param_lowp)

    def _lion(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        """lion-pytorch's update_fn (its lerp form)."""
        lr, beta1, beta2, weight_decay, maximize, grad_scale = hyper
        p, exp_avg = param.view(-1), states[0].view(-1)
        g = _scaled_grad(grad, grad_scale, maximize, p.dtype)
        p.mul_(1 - lr * weight_decay)
        update = exp_avg.clone().lerp_(g, 1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.lerp_(g, 1 - beta2)
        _copy_lowp(p, param_lowp)

    def float64_step(self, rule: Rule, param: torch.Tensor, grad: torch.Tensor,
                     states: Sequence[torch.Tensor], *, step: int, **hyper) -> None:
        """One step of ``rule`` (its float32-state form) on a float64 ``param``, ``grad`` and
        ``states`` (1-D, contiguous, in field order), in float64: the same statements as the
        float32 reference, for params the float32 kernels do not take ([Note: float64
        params] in offload/optim/host_dtypes.py)."""
        k = _KERNELS.get(rule)
        if k is None:
            raise ValueError(f"float64_step: {getattr(rule, 'name', rule)!r} is not a rule with float32 states")
        if len(states) != len(k.names):
            raise ValueError(f"float64_step: rule {rule.name!r} keeps {list(k.names)}, got {len(states)} states")
        n = param.numel()
        for name, t in (("param", param), ("grad", grad)) + tuple(zip(k.names, states)):
            if t.dtype != torch.float64 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() \
                    or t.numel() != n:
                raise ValueError(f"float64_step: {name} must be a 1-D contiguous float64 CPU tensor of {n} "
                                 f"elements, got {t.dtype} {list(t.shape)} on {t.device}")
        args = _bind(k, step, hyper)
        if n:
            getattr(self, k.method)(param, grad, tuple(states), None, None, args)

    def _compressed(self, method, fields, param, grad, states, param_lowp, num_threads, hyper,
                    q) -> None:
        """The scheme as written: decode, this backend's float32 rule, encode."""
        compose_step(getattr(self, method), fields, param, grad, states, param_lowp,
                     num_threads, hyper, q)

    def grad_sumsq(self, grad: torch.Tensor, *,
                   num_threads: Optional[int] = None) -> Tuple[float, bool]:
        check_tensor("grad", grad, GRAD_DTYPES)
        check_threads(num_threads)
        g = grad.view(-1)
        total = 0.0
        # Accumulate in double, a chunk at a time, so memory stays bounded. A double sum of
        # squares of finite fp32 values cannot overflow (n * 2**256 << 2**1024), so the sum
        # is non-finite exactly when some element is.
        for start in range(0, g.numel(), _CHUNK):
            c = g[start:start + _CHUNK].double()
            total += float(torch.dot(c, c))
        return total, not math.isfinite(total)


def _scaled_grad(grad: torch.Tensor, grad_scale: float, maximize: bool, dtype: torch.dtype) -> torch.Tensor:
    """grad in the param's ``dtype`` (float32, or float64) times grad_scale, negated when
    maximizing; a new tensor whenever it differs from ``grad`` (the caller never writes into it)."""
    g = grad.view(-1).to(dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    return -g if maximize else g


def _copy_lowp(p: torch.Tensor, param_lowp: Optional[torch.Tensor]) -> None:
    if param_lowp is not None:
        param_lowp.view(-1).copy_(p)
