"""``offload.Lion``: lion-pytorch's ``Lion`` (Chen et al. 2023, "Symbolic Discovery of
Optimization Algorithms") over the offload stores.

The update, per element: ``p *= 1 - lr * weight_decay``; ``p -= lr * sign(lerp(exp_avg,
g, 1 - beta1))``; ``exp_avg = lerp(exp_avg, g, 1 - beta2)``. One state, ``exp_avg`` (half
of Adam's bytes). lion-pytorch refuses bad values with ``assert``; here they are
ValueErrors in torch's words.
"""
from __future__ import annotations

from typing import Any, Dict

from offload.kernels.fields import LION, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.options import _check_scalar
from offload.optim.protocol import optional
from offload.optim.rule_options import check_flag_types, check_lr, check_nonneg, to_float
from offload.optim.state_view import attach as attach_state_views

__all__ = ["Lion"]


def _check_args(lr: Any, betas: Any, weight_decay: Any) -> None:
    """lion-pytorch's asserts, as ValueErrors in torch's words."""
    check_lr(lr)
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _check_scalar(f"betas[{i}]", b, tensor_ok=False)
        if not 0.0 <= b <= 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    check_nonneg("weight_decay", weight_decay, "weight_decay value")


def _check_not_decoupled(group: Dict[str, Any]) -> None:
    """lion-pytorch's ``decoupled_weight_decay=True`` (weight decay divided by the initial lr)
    is not this update: refused by name wherever a group enters or steps (stepping it as
    ``lr * weight_decay`` would decay the params 1/lr times as hard as lion-pytorch does)."""
    if group.get("decoupled_weight_decay"):
        raise ValueError("a group with lion-pytorch's decoupled_weight_decay=True (weight decay divided by "
                         "the initial lr); offload.Lion decays by lr * weight_decay: set the group's "
                         "weight_decay to weight_decay / initial lr and decoupled_weight_decay to False")


class Lion(RuleOptimizer):
    """Lion with offloaded states and fused SIMD kernels: lion-pytorch's arguments and
    defaults (``lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0``; weight decay decoupled and
    scaled by lr, as there), ``maximize``, and the options of :class:`offload.Adam`."""

    GROUP_DEFAULTS = (("maximize", False),)
    TORCH_NAME = "Lion"
    SPARSE_MESSAGE = "offload.Lion does not support sparse gradients"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 **offload_kwargs: Any) -> None:
        _check_args(lr, betas, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **offload_kwargs)
        if optional(self._store, "resumed"):  # states from a previous run's swap files
            attach_state_views(self)  # opt.state[p] shows them now, as after a load, not after the next step

    @classmethod
    def check_group(cls, group: Dict[str, Any]) -> None:
        """The constructor's checks over a whole group's values (a group added or loaded: options.check_group_values)."""
        check_flag_types(cls.GROUP_DEFAULTS, group)
        _check_args(group["lr"], group["betas"], group["weight_decay"])
        _check_not_decoupled(group)

    def _check_group(self, group: Dict[str, Any]) -> None:
        _check_not_decoupled(group)  # a group changed after it entered: refused before the step changes anything

    def rule_of(self, group: Dict[str, Any]) -> Rule:
        return LION

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Ours, or lion-pytorch's layout: its entries hold ``exp_avg`` and no ``"step"``
        (counted here as one step taken, as a loaded SGD buffer is), and its groups no
        ``maximize`` (False). lion-pytorch's ``decoupled_weight_decay=True`` (weight decay
        divided by the initial lr) is not this update: refused before anything is loaded."""
        super().load_state_dict(self.loadable_form(state_dict))

    def loadable_form(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` (ours or lion-pytorch's) in ours, as :meth:`load_state_dict` loads it
        (state_io.check_loadable's form: a stage 3 checkpoint checks it first)."""
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
            for g in state_dict.get("param_groups") or ():
                if isinstance(g, dict):
                    try:
                        _check_not_decoupled(g)
                    except ValueError as exc:
                        raise ValueError(f"load_state_dict: {exc}") from None
            state = {k: (dict(st, step=st.get("step", 1.0)) if isinstance(st, dict) and "exp_avg" in st else st)
                     for k, st in state_dict["state"].items()}
            state_dict = dict(state_dict, state=state)
        return state_dict

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=to_float(group, "lr"), beta1=float(beta1), beta2=float(beta2),
                    weight_decay=float(group["weight_decay"]), maximize=bool(group.get("maximize", False)))
