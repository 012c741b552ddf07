"""``offload.SGD``: drop-in for ``torch.optim.SGD`` over the offload stores.

Rule ``SGD`` (state ``momentum_buffer``) for a group with momentum, ``SGD_PLAIN`` (no
state) for one without. torch's SGD keeps no ``"step"``, and no state at all for a param
without momentum (older torch: ``{"momentum_buffer": None}``); the kernels need to know a buffer's first step (it starts as ``d_p``,
without dampening), so here the count lives in ``opt.state[p]["step"]`` as for every rule,
and ``state_dict()`` / ``load_state_dict()`` translate to and from torch's layout: no
``"step"``, no entry for a param without momentum (a None buffer loads as none). A
loaded buffer means at least one step was taken (count 1: the next step is not the first).
"""
from __future__ import annotations

from typing import Any, Dict

from offload.kernels.fields import SGD as SGD_RULE, SGD_PLAIN, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.rule_options import check_flags, check_lr, check_nonneg, to_float

__all__ = ["SGD"]

_BUF = "momentum_buffer"


class SGD(RuleOptimizer):
    """``torch.optim.SGD`` with offloaded states and fused SIMD kernels.

    Same arguments, defaults, validation messages and ``state_dict`` layout as torch's, plus
    the options of :class:`offload.Adam` (``offload``, ``swap_dir``, ``backend``,
    ``num_threads``, ``max_grad_norm``, ``stage``, ...). ``foreach`` and ``fused`` are
    accepted (every step is one fused pass per tensor); ``differentiable=True`` is refused.
    """

    GROUP_DEFAULTS = (("nesterov", False), ("maximize", False), ("foreach", None),
                      ("differentiable", False), ("fused", False))
    TORCH_NAME = "SGD"
    SPARSE_MESSAGE = "offload.SGD does not support sparse gradients; use torch.optim.SGD for them"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, **offload_kwargs: Any) -> None:
        check_lr(lr)
        check_nonneg("momentum", momentum, "momentum value")
        check_nonneg("weight_decay", weight_decay, "weight_decay value")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        check_flags("SGD", foreach=foreach, differentiable=differentiable, fused=fused)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, **offload_kwargs)

    def rule_of(self, group: Dict[str, Any]) -> Rule:
        # A flat or swapped store keeps one rule's fields: with any group with momentum, the
        # buffer's, which a group without momentum leaves untouched (as torch leaves one)
        if group["momentum"] != 0 or getattr(self, "_store_rule", None) is SGD_RULE:
            return SGD_RULE
        return SGD_PLAIN

    def store_rule(self) -> Rule:
        return SGD_RULE if any(g["momentum"] != 0 for g in self.param_groups) else SGD_PLAIN

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(lr=to_float(group, "lr"), weight_decay=to_float(group, "weight_decay"),
                   maximize=bool(group.get("maximize", False)))
        if self.rule_of(group) is SGD_RULE:
            out.update(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                       nesterov=bool(group.get("nesterov", False)))
        return out

    def _check_group(self, group: Dict[str, Any]) -> None:
        # torch checks nesterov once, at construction; a group edited since is checked here,
        # before anything changes, rather than inside the kernel call of one param
        if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def state_names(self):
        return (_BUF,)  # every group's, with or without momentum (momentum may change)

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout: ``{"momentum_buffer": tensor}`` per param with momentum that stepped."""
        sd = super().state_dict()
        # a param of a group without momentum has no state in torch (a flat store keeps an
        # untouched buffer for it); the others have their buffer and no "step"
        plain = {i for g in sd["param_groups"] if g["momentum"] == 0 for i in g["params"]}
        state = {}
        for k, st in sd["state"].items():
            entry = {key: v for key, v in st.items() if key != "step" and not (key == _BUF and k in plain)}
            if entry:  # (a bf16 param keeps its fp32 "master", ours)
                state[k] = entry
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's layout (or ours): a ``None`` buffer is dropped, and an entry without a
        ``"step"`` counts one step taken (its buffer, if any, is not started afresh)."""
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
            state = {}
            for k, st in state_dict["state"].items():
                if isinstance(st, dict):
                    st = {key: v for key, v in st.items() if not (key == _BUF and v is None)}
                    st.setdefault("step", 1.0)
                state[k] = st
            state_dict = dict(state_dict, state=state)
        super().load_state_dict(state_dict)
