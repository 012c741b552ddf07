"""``offload.Adam`` and ``offload.AdamW``: drop-in for ``torch.optim.Adam`` / ``AdamW``.

Same arguments, defaults, validation messages and ``state_dict`` layout as torch's; the
extras choose where the fp32 states live (``offload=``) and which kernel runs
(``backend=``). Everything but Adam's own arguments and rule is the shared frame,
``offload.optim.base.RuleOptimizer`` (stores, step, state_dict, checkpoints).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

import torch

from offload.kernels.fields import ADAM, ADAM_AMSGRAD, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.ckpt_holding import holding_ids, holding_meta, holding_of, record_now, saved_holding, without_cleared
from offload.optim.differentiable import TorchWhenDifferentiable
from offload.optim.functional import AdamHyper, RuleHyper
from offload.optim.options import check_hyper
from offload.optim.protocol import optional
from offload.optim.rule_options import check_flag_types, torch_flags_off
from offload.optim.state_view import attach as attach_state_views

__all__ = ["Adam", "AdamW"]


def _to_float(x: Any, what: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {what} must be 1-element")
        return float(x.item())
    return float(x)


class _AdamBase(TorchWhenDifferentiable, RuleOptimizer):
    GROUP_DEFAULTS = (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                      ("differentiable", False), ("decoupled_weight_decay", False), ("fused", None))
    SPARSE_MESSAGE = "Adam does not support sparse gradients, please consider SparseAdam instead"

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False, bias_correction: bool = True,
                 **offload_kwargs: Any) -> None:
        # Everything is checked before `params` is touched, as torch does.
        betas = check_hyper(lr, betas, eps, weight_decay, amsgrad, foreach=foreach, capturable=capturable,
                            differentiable=differentiable, fused=fused)
        # checked with the offload options (check_extras) before params are touched
        self.bias_correction = bias_correction
        # `foreach` and `fused` are accepted for signature compatibility: every step here is
        # one fused pass per tensor whatever they say, which honours both requests.
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        # id(p) of the flat / swapped stores' params that hold a max_exp_avg_sq in torch's
        # eyes (stepped with amsgrad, or loaded with one): shown also while their group has
        # amsgrad off, as torch keeps it then (kept_states)
        self._ams_kept: Set[int] = set()
        super().__init__(params, defaults, **offload_kwargs)
        keep = optional(self._store, "keep_optional")
        if keep is not None:  # the host store, built with no group of amsgrad: a group may turn it on
            keep(ADAM_AMSGRAD.fields)
        if optional(self._store, "resumed"):  # states from a previous run's swap files
            # (their last commit says which params hold one, as a checkpoint's meta does)
            held = holding_ids(self._ctx.commit_meta, "max_exp_avg_sq", self._all_params(), "the resumed swap files")
            self._set_kept(self._ams_by_steps() if held is None else held)
            attach_state_views(self)  # opt.state[p] shows the resumed states, as after a load

    @classmethod
    def check_group(cls, group: Dict[str, Any]) -> None:
        """The constructor's checks over a whole group's values (a group added or loaded: options.check_group_values)."""
        check_flag_types(cls.GROUP_DEFAULTS, group)
        group = torch_flags_off(group)
        check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"],
                    foreach=group.get("foreach"), capturable=group.get("capturable", False),
                    differentiable=group.get("differentiable", False), fused=group.get("fused"))

    def _ams_by_steps(self) -> Set[int]:
        """What a store that keeps no such flag (a checkpoint, resumed swap files) says: a
        param of a group with amsgrad that stepped holds its max_exp_avg_sq."""
        return {id(p) for g in self.param_groups if g.get("amsgrad")
                for p in g["params"] if self._ctx.steps.get(p) > 0}

    def _set_kept(self, kept: Set[int]) -> None:
        """``_ams_kept`` is now ``kept``; the swapped stores record it with each commit
        (StepContext.commit_meta), so that a resume shows what the run showed. Called when
        it changes only: the per-param work here is not per step."""
        self._ams_kept = kept
        if getattr(self._store, "kind", None) != "host":
            self._ctx.commit_meta = holding_of("max_exp_avg_sq", self._all_params(), kept)

    def kept_states(self) -> Dict[int, Tuple[str, ...]]:
        """id(p) -> the states ``p`` holds beyond its group's rule (state_view.seen_names):
        torch keeps a param's max_exp_avg_sq when its group turns amsgrad off, and uses it
        again when the group turns it back on; the flat and swapped stores keep it too ([Note:
        groups of different rules] in kernels/fields.py), so it shows as torch's does. Asked
        once per step for every param (empty without amsgrad: nothing to look up per param)."""
        return dict.fromkeys(self._ams_kept, ("max_exp_avg_sq",))

    def _store_step(self, work, multiplier: float) -> Dict[str, float]:
        # before the step: its commit records the params that hold a max_exp_avg_sq after it
        before = self._ams_kept
        kept = without_cleared(self, before, work)  # (a cleared param holds none, as in torch)
        stepped = {id(p) for group, items in work if group.get("amsgrad") for p, *_ in items}
        if kept is not before or not stepped <= kept:
            self._set_kept(kept | stepped)
        try:
            return super()._store_step(work, multiplier)
        except BaseException:  # a step that failed (swap files at the step before): as before it
            if self._ams_kept is not before:
                self._set_kept(before)
            raise

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch pairs the saved groups' param ids with ours, in order: a param holds a
        # max_exp_avg_sq when its entry had one (whatever its group's amsgrad says now)
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        state = state_dict["state"]
        self._set_kept({id(p) for k, p in zip(saved, self._all_params())
                        if isinstance(state.get(k), dict) and "max_exp_avg_sq" in state[k]})
        record_now(self._store)
        attach_state_views(self)  # (attached by the load before the kept states were known)

    def rule_of(self, group: Dict[str, Any]) -> Rule:
        # amsgrad=True keeps a third state, max_exp_avg_sq (torch's); groups may differ in
        # the host store, not in a flat or swapped one (base.store_rule says so)
        return ADAM_AMSGRAD if group.get("amsgrad") else ADAM

    def _hyper(self, group: Dict[str, Any], grad_scale: float):
        hyper = self._adam_hyper(group, grad_scale)
        if group.get("amsgrad"):  # the same hyperparameters, the rule with the third state
            values = hyper.kernel_kwargs(0)
            del values["step"], values["grad_scale"]
            return RuleHyper(ADAM_AMSGRAD, tuple(values.items()), grad_scale)
        return hyper

    def _adam_hyper(self, group: Dict[str, Any], grad_scale: float) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=_to_float(group["lr"], "lr"),
            beta1=_to_float(beta1, "betas[0]"),
            beta2=_to_float(beta2, "betas[1]"),
            eps=_to_float(group["eps"], "eps"),
            weight_decay=_to_float(group["weight_decay"], "weight_decay"),
            decoupled=bool(group.get("decoupled_weight_decay", False)),
            maximize=bool(group.get("maximize", False)),
            bias_correction=self.bias_correction,
            grad_scale=grad_scale,
        )

    def checkpoint_meta(self) -> Dict[str, Any]:
        """The params that hold a max_exp_avg_sq ([Note: kept states in checkpoints] in
        ckpt_holding.py): in the host store, those whose opt.state has one (torch's dicts);
        in the others, those that stepped in a group with amsgrad now or kept one since."""
        host = getattr(self._store, "kind", None) == "host"
        pairs = [(g, p) for g in self.param_groups for p in g["params"]]
        return holding_meta("max_exp_avg_sq", (
            i for i, (g, p) in enumerate(pairs)
            if ("max_exp_avg_sq" in self.state.get(p, {}) if host else
                self._ctx.steps.get(p) > 0 and (g.get("amsgrad") or id(p) in self._ams_kept))))

    def load_checkpoint(self, directory: str) -> None:
        params = self._all_params()
        held = saved_holding(directory, "max_exp_avg_sq", len(params))  # (checked before anything loads)
        super().load_checkpoint(directory)
        # A checkpoint holds every state of the store's fields for every param that stepped
        # (a max_exp_avg_sq of zeros where a param has none): a param holds its
        # max_exp_avg_sq when the meta says so, or (a checkpoint written before it said) when
        # its group has amsgrad. The host store, whose opt.state is torch's, drops the others,
        # as torch's dicts have none; the flat and swapped stores show the held ones.
        holds = {id(p) for i, p in enumerate(params) if held is not None and i in held}
        if held is None:  # (not beside the meta: a param stepped before its group turned amsgrad on has none)
            holds.update(id(p) for g in self.param_groups if g.get("amsgrad") for p in g["params"])
        self._set_kept({id(p) for p in params if id(p) in holds and self._ctx.steps.get(p) > 0})
        record_now(self._store)
        if getattr(self._store, "kind", None) != "host":
            attach_state_views(self)  # (attached by the load before the kept states were known)
            return
        for p in params:
            if id(p) not in holds:
                self.state.get(p, {}).pop("max_exp_avg_sq", None)

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        hyper = self._adam_hyper(group, 1.0).kernel_kwargs(0)
        del hyper["step"], hyper["grad_scale"]
        return hyper


class Adam(_AdamBase):
    """``torch.optim.Adam`` with offloaded states and fused SIMD kernels.

    Same arguments and defaults as ``torch.optim.Adam`` (``decoupled_weight_decay=True``
    makes it AdamW), plus: ``offload`` ("none", "cpu", "nvme"), ``swap_dir``,
    ``max_host_bytes``, ``sub_group_size``, ``verify``, ``resume``, ``io_engine`` (a name, an
    ``IOConfig`` or a tuning file of ``offload bench-io --tune``; the swap options need
    ``offload="nvme"``),
    ``backend`` ("native", "numba", "torch"; default ``$OFFLOAD_BACKEND`` or auto),
    ``num_threads``, ``max_grad_norm`` (global-norm clipping inside the step),
    ``bias_correction``, ``stage`` and ``process_group`` (ZeRO partitioning),
    ``amsgrad=True`` keeps torch's third state, ``max_exp_avg_sq`` (in the state_dict as
    torch's; 4 more bytes per param in float32, 1 in int8),
    ``state_dtype`` ("float32", the default; "bfloat16": states as bf16, rounded
    stochastically in the step; "int8": block-wise 8-bit states, 256 codes and a float32
    scale per 256 elements) and ``master_dtype`` (None; "bfloat16" with bfloat16 params:
    each param is its own master, updated with stochastic rounding, no fp32 copy kept) and
    ``release_grads`` (False; True with CUDA params and ``offload="cpu"``/``"nvme"`` at stages
    0-2: each grad leaves the device in backward and ``p.grad`` is None afterwards; clip with
    ``max_grad_norm``: offload/optim/flat/grads.py, [Note: releasing grads]).
    With fp32 CPU params a param of fewer than 4096 elements keeps float32 states, and
    ``opt.state[p]`` holds the states as stored (a bf16 tensor of p's shape, or 1-D uint8
    packed blocks for int8); ``state_dict()`` gives them as float32 in torch's layout, and
    ``load_state_dict()`` of a float32 (torch) dict encodes them.
    ``differentiable=True`` returns a ``torch.optim.Adam``, with a warning (differentiable.py).
    """

    TORCH_CLASS = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, **offload_kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay, **offload_kwargs)


class AdamW(_AdamBase):
    """``torch.optim.AdamW`` with offloaded states and fused SIMD kernels.

    Same arguments and defaults as ``torch.optim.AdamW``, plus the options of
    :class:`offload.Adam`.
    """

    TORCH_CLASS = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, **offload_kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, **offload_kwargs)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
