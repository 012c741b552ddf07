"""``offload.Adagrad``: drop-in for ``torch.optim.Adagrad`` over the offload stores.

As torch, the states exist from construction: ``"step"`` (0) and ``"sum"`` filled with
``initial_accumulator_value`` for every param, so ``state_dict()`` moves both ways with
``torch.optim.Adagrad`` before and after the first step. In every store: a param whose count
is 0 keeps a ``"step"`` of 0 in ``opt.state[p]`` (the counts' own convention drops it: see
``StepCounts.set``), put back after construction and every load, with ``opt.state[p]["sum"]``
a view (or swap reader, ``state_view.py``) as after a step; a swap store that exports no
states for a param that never stepped has them filled here, which is what its files hold.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch.optim.optimizer import _get_scalar_dtype

from offload.kernels.fields import ADAGRAD, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.differentiable import TorchWhenDifferentiable
from offload.optim.host_dtypes import fill_value, state_dtype_of
from offload.optim.protocol import optional
from offload.optim.rule_options import (check_flag_types, check_flags, check_lr, check_nonneg, to_float,
                                        torch_flags_off)
from offload.optim.state_view import attach as attach_state_views

__all__ = ["Adagrad"]


def _check_args(lr: Any, lr_decay: Any, weight_decay: Any, initial_accumulator_value: Any, eps: Any, foreach: Any,
                differentiable: Any, fused: Any) -> None:
    """torch.optim.Adagrad's checks, in its order."""
    check_lr(lr)
    check_nonneg("lr_decay", lr_decay, "lr_decay value")
    check_nonneg("weight_decay", weight_decay, "weight_decay value")
    check_nonneg("initial_accumulator_value", initial_accumulator_value, "initial_accumulator_value value")
    check_nonneg("eps", eps, "epsilon value")
    check_flags("Adagrad", foreach=foreach, differentiable=differentiable, fused=fused)


class Adagrad(TorchWhenDifferentiable, RuleOptimizer):
    """``torch.optim.Adagrad`` with offloaded states and fused SIMD kernels.

    Same arguments, defaults, validation messages and ``state_dict`` layout as torch's, plus
    the options of :class:`offload.Adam`. ``foreach`` and ``fused`` are accepted (every step
    is one fused pass per tensor); ``differentiable=True`` is refused.
    """

    GROUP_DEFAULTS = (("foreach", None), ("maximize", False), ("differentiable", False), ("fused", None))
    TORCH_NAME = "Adagrad"
    TORCH_CLASS = torch.optim.Adagrad  # differentiable=True: torch's (differentiable.py)
    SPARSE_GRADS = True  # stepped as their dense equivalent: [Note: sparse grads] in sparse_grads.py
    SPARSE_MESSAGE = "offload.Adagrad takes sparse grads in torch's sparse COO layout only"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, **offload_kwargs: Any) -> None:
        _check_args(lr, lr_decay, weight_decay, initial_accumulator_value, eps, foreach, differentiable, fused)
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, **offload_kwargs)
        self._torch_entries()

    @classmethod
    def check_group(cls, group: Dict[str, Any]) -> None:
        """The constructor's checks over a whole group's values (a group added or loaded: options.check_group_values)."""
        check_flag_types(cls.GROUP_DEFAULTS, group)
        group = torch_flags_off(group)
        _check_args(*(group[k] for k in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps",
                                        "foreach", "differentiable", "fused")))

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
        # torch's constructor: step 0 for every param, before any step; the filled sums
        # come with the store (_seed_store), one param at a time
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())

    def _new_sum(self, p: torch.Tensor) -> torch.Tensor:
        # fp32 whatever p's dtype: the stores keep fp32 states, and a bf16 seed would round
        # the fill (0.1 -> 0.10009765625) before the flat store copies it; complex64 or
        # float64 for such a param, as torch's (a complex sum filled with complex(v, v)):
        # [Note: complex params]
        return torch.full_like(p, fill_value(p, self.state_fill("sum")), dtype=state_dtype_of(p),
                               memory_format=torch.preserve_format)

    def _seed_store(self) -> None:
        """torch's filled ``sum`` for every param, one param at a time: made as the host store
        keeps it (encoded from one block with compressed states), or imported into the flat
        or swapped store. Made for every param first, the float32 sums of the whole model
        were held at once (a 24M-param model built with int8 states on NVMe peaked 196 MiB
        for 14 MiB of states; a model too large for RAM could not be built at all)."""
        params = self._all_params()
        if self._host():
            for p in params:  # float32 as torch's, or encoded from one block (state_dtype)
                self._store.make_states(p)
            return
        if optional(self._store, "resumed"):  # the swap files hold the states (a sum that grew)
            return
        for p in params:
            self._store.import_state(p, {"sum": self._new_sum(p)})

    def _host(self) -> bool:
        return getattr(self._store, "kind", "host") == "host"

    def _torch_entries(self) -> None:
        """torch's entries of a param that never stepped: ``"step"`` 0 and ``"sum"``."""
        for p in self._all_params():
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            if self._host() and "sum" not in st:  # (the host store would create it at the first step)
                st["sum"] = torch.full_like(p, self.state_fill("sum"), memory_format=torch.preserve_format)
        if not self._host():
            attach_state_views(self)
        else:
            self._store.settle()  # a sum made here is encoded as state_dtype stores it

    def _torch_state_layout(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        """torch's layout: every param has its ``sum`` from the start (state_io.state_dict_of
        calls it before the post hooks)."""
        fill = self.state_fill("sum")
        for i, p in enumerate(self._all_params()):
            entry = sd["state"].setdefault(i, {})
            if "sum" not in entry and self._ctx.steps.get(p) == 0:
                # torch's key order: step, then sum, then ours ("master")
                rest = {k: v for k, v in entry.items() if k != "step"}
                entry.clear()
                entry.update(step=torch.tensor(0.0, dtype=_get_scalar_dtype()),
                             sum=torch.full(p.shape, fill, dtype=torch.float32), **rest)
        return sd

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_store", None) is None:  # (torch's __init__ adds the constructor's groups)
            return
        if not self._host():  # a flat store's new fields start at zero: its sum starts filled, as at construction
            for p in self.param_groups[-1]["params"]:
                self._store.import_state(p, {"sum": self._new_sum(p)})
        self._torch_entries()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._torch_entries()

    def load_checkpoint(self, directory: str) -> None:
        super().load_checkpoint(directory)
        self._torch_entries()
