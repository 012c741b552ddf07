"""``offload.Adagrad``: drop-in for ``torch.optim.Adagrad`` over the offload stores.

As torch, the states exist from construction: ``"step"`` (0) and ``"sum"`` filled with
``initial_accumulator_value`` for every param, so ``state_dict()`` moves both ways with
``torch.optim.Adagrad`` before and after the first step.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch.optim.optimizer import _get_scalar_dtype

from offload.kernels.fields import ADAGRAD, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.rule_options import check_flags, check_lr, check_nonneg, to_float

__all__ = ["Adagrad"]


class Adagrad(RuleOptimizer):
    """``torch.optim.Adagrad`` with offloaded states and fused SIMD kernels.

    Same arguments, defaults, validation messages and ``state_dict`` layout as torch's, plus
    the options of :class:`offload.Adam`. ``foreach`` and ``fused`` are accepted (every step
    is one fused pass per tensor); ``differentiable=True`` is refused.
    """

    GROUP_DEFAULTS = (("foreach", None), ("maximize", False), ("differentiable", False), ("fused", None))
    TORCH_NAME = "Adagrad"
    SPARSE_MESSAGE = "offload.Adagrad does not support sparse gradients; use torch.optim.Adagrad for them"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, **offload_kwargs: Any) -> None:
        check_lr(lr)
        check_nonneg("lr_decay", lr_decay, "lr_decay value")
        check_nonneg("weight_decay", weight_decay, "weight_decay value")
        check_nonneg("initial_accumulator_value", initial_accumulator_value, "initial_accumulator_value value")
        check_nonneg("eps", eps, "epsilon value")
        check_flags("Adagrad", foreach=foreach, differentiable=differentiable, fused=fused)
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, **offload_kwargs)

    def rule_of(self, group: Dict[str, Any]) -> Rule:
        return ADAGRAD

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return dict(lr=to_float(group, "lr"), lr_decay=float(group["lr_decay"]),
                    weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                    maximize=bool(group.get("maximize", False)))

    def state_fill(self, name: str) -> float:
        # torch fills every param's sum with the constructor's value, whatever a param
        # group says (its group's "initial_accumulator_value" is only recorded)
        return float(self.defaults["initial_accumulator_value"])

    def _init_states(self) -> None:
        # torch's constructor: step 0 and the filled sum for every param, before any step
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["sum"] = torch.full_like(p, self.state_fill("sum"), memory_format=torch.preserve_format)
