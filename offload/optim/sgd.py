"""``offload.SGD``: drop-in for ``torch.optim.SGD`` over the offload stores.

Rule ``SGD`` (state ``momentum_buffer``) for a group with momentum, ``SGD_PLAIN`` (no
state) for one without. torch's SGD keeps no ``"step"``, and no state at all for a param
without momentum (older torch: ``{"momentum_buffer": None}``); the kernels need to know a buffer's first step (it starts as ``d_p``,
without dampening), so here the count lives in ``opt.state[p]["step"]`` as for every rule,
and ``state_dict()`` / ``load_state_dict()`` translate to and from torch's layout: no
``"step"``, no entry for a param without momentum (a None buffer loads as none). A
loaded buffer means at least one step was taken (count 1: the next step is not the first).

A buffer starts (torch: ``buf is None`` -> ``buf = clone(d_p)``) on a param's first step
with momentum, whatever its count: a group whose momentum goes from 0 to 0.9 mid-run, or a
flat store's buffer kept for a group without momentum. Such a param is stepped with
dampening 0 over its still-zero buffer (``0 * m + d_p`` is ``d_p`` exactly), which leaves
the counts alone (the swap stores commit them from each work item). Which buffers started:
the host store's ``opt.state`` says (torch's own); the other stores keep a set, refilled by
``load_state_dict`` (an entry with a buffer), ``load_checkpoint`` (the checkpoint's meta
``holding``: [Note: kept states in checkpoints] in ckpt_holding.py) and ``resume=True`` (the
same map, recorded with each swap commit). Their ``opt.state[p]`` shows a buffer where it
started only (``shown_rule``, ``kept_states``, ``hidden_states``): a param that never stepped
with momentum has none, as in torch, though the store keeps one for every param once any
group has momentum.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from offload.kernels.fields import SGD as SGD_RULE, SGD_PLAIN, Rule
from offload.optim.base import RuleOptimizer
from offload.optim.ckpt_holding import holding_ids, holding_of, record_now, saved_holding, without_cleared
from offload.optim.differentiable import TorchWhenDifferentiable
from offload.optim.options import _check_scalar
from offload.optim.protocol import optional
from offload.optim.rule_options import (check_flag_types, check_flags, check_lr, check_nonneg, to_float,
                                        torch_flags_off)
from offload.optim.state_entry import SwappedEntry
from offload.optim.state_io import id_map
from offload.optim.state_view import attach as attach_state_views
from offload.optim.step_guard import store_step

__all__ = ["SGD"]

_BUF = "momentum_buffer"


def _is_hole(value: Any) -> bool:
    return isinstance(value, dict) and not value


def _check_args(lr: Any, momentum: Any, dampening: Any, weight_decay: Any, nesterov: Any, foreach: Any,
                differentiable: Any, fused: Any) -> None:
    """torch.optim.SGD's checks, in its order."""
    check_lr(lr)
    check_nonneg("momentum", momentum, "momentum value")
    check_nonneg("weight_decay", weight_decay, "weight_decay value", tensor_ok=True)  # float | Tensor, as torch
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    check_flags("SGD", foreach=foreach, differentiable=differentiable, fused=fused)


class SGD(TorchWhenDifferentiable, RuleOptimizer):
    """``torch.optim.SGD`` with offloaded states and fused SIMD kernels.

    Same arguments, defaults, validation messages and ``state_dict`` layout as torch's, plus
    the options of :class:`offload.Adam` (``offload``, ``swap_dir``, ``backend``,
    ``num_threads``, ``max_grad_norm``, ``stage``, ...). ``foreach`` and ``fused`` are
    accepted (every step is one fused pass per tensor); ``differentiable=True`` is refused.
    """

    # a loaded entry without a buffer is a param that never stepped with momentum (torch's
    # None): a "step" alone is no missing state here (state_io._check_not_bare)
    BARE_STEP_STARTS_AFRESH = True

    GROUP_DEFAULTS = (("nesterov", False), ("maximize", False), ("foreach", None),
                      ("differentiable", False), ("fused", False))
    TORCH_NAME = "SGD"
    TORCH_CLASS = torch.optim.SGD  # differentiable=True: torch's (differentiable.py)
    SPARSE_GRADS = True  # stepped as their dense equivalent: [Note: sparse grads] in sparse_grads.py
    SPARSE_MESSAGE = "offload.SGD takes sparse grads in torch's sparse COO layout only"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, **offload_kwargs: Any) -> None:
        _check_args(lr, momentum, dampening, weight_decay, nesterov, foreach, differentiable, fused)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        self._buf_started: Set[int] = set()  # id(p) of the flat / swapped stores' started buffers
        # (the groups' momentum flags, kept_states, hidden_states): made again when _buf_started
        # or a group's momentum changes, not per step
        self._shown: Optional[Tuple[Any, Dict[int, Tuple[str, ...]], Dict[int, Tuple[str, ...]]]] = None
        super().__init__(params, defaults, **offload_kwargs)
        keep = optional(self._store, "keep_optional")
        if keep is not None:  # the host store, built with no group of momentum: a group may turn it on,
            keep(SGD_RULE.fields)  # and its checkpoints then hold the buffers (as Adam's max_exp_avg_sq)
        if optional(self._store, "resumed"):  # states from a previous run's swap files
            # (their last commit says which buffers started, as a checkpoint's meta does)
            held = holding_ids(self._ctx.commit_meta, _BUF, self._params_in_order(), "the resumed swap files")
            self._set_started(self._started_by_steps() if held is None else held)
            attach_state_views(self)  # opt.state[p] shows the resumed states, as after a load

    @classmethod
    def check_group(cls, group: Dict[str, Any]) -> None:
        """The constructor's checks over a whole group's values (a group added or loaded:
        options.check_group_values), and dampening's type, which torch leaves to the step."""
        check_flag_types(cls.GROUP_DEFAULTS, group)
        group = torch_flags_off(group)
        _check_scalar("dampening", group["dampening"], tensor_ok=False)
        _check_args(*(group[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "foreach",
                                        "differentiable", "fused")))

    def _set_started(self, started: Set[int]) -> None:
        """``_buf_started`` is now ``started`` (a new set: kept_states is made again); the
        swapped stores record it with each commit (StepContext.commit_meta). Called when it
        changes only: the per-param work here is not per step."""
        self._buf_started, self._shown = started, None
        if getattr(self._store, "kind", None) != "host":
            self._ctx.commit_meta = holding_of(_BUF, self._params_in_order(), started)

    def shown_rule(self, group: Dict[str, Any]) -> Rule:
        """The states a param of ``group`` shows (state_view): its own rule's, where rule_of
        gives the store's (a buffer for every param once any group has momentum)."""
        return SGD_RULE if group["momentum"] != 0 else SGD_PLAIN

    def _shown_maps(self) -> Tuple[Dict[int, Tuple[str, ...]], Dict[int, Tuple[str, ...]]]:
        """(kept_states, hidden_states): the started buffers of groups without momentum, the
        buffers not started of groups with momentum; both empty in most runs (attach then
        looks nothing up per param)."""
        flags = tuple(g["momentum"] != 0 for g in self.param_groups)
        if self._shown is None or self._shown[0] != flags:
            started, kept, hidden = self._buf_started, {}, {}
            for on, group in zip(flags, self.param_groups):
                for p in group["params"]:
                    if on != (id(p) in started):
                        (hidden if on else kept)[id(p)] = (_BUF,)
            self._shown = (flags, kept, hidden)
        return self._shown[1], self._shown[2]

    def kept_states(self) -> Dict[int, Tuple[str, ...]]:
        """id(p) -> the buffer, for a param of a group without momentum whose buffer started
        (torch keeps it while momentum is 0): state_view.seen_names."""
        return self._shown_maps()[0]

    def hidden_states(self) -> Dict[int, Tuple[str, ...]]:
        """id(p) -> the buffer, for a param of a group with momentum whose buffer did not start
        (torch's state has none yet): state_view.seen_names."""
        return self._shown_maps()[1]

    def _started_by_steps(self) -> Set[int]:
        """What a store that keeps no "started" flag (a checkpoint, resumed swap files) says: a
        param of a group with momentum that stepped has its buffer."""
        return {id(p) for g in self.param_groups if g["momentum"] != 0
                for p in g["params"] if self._ctx.steps.get(p) > 0}

    def rule_of(self, group: Dict[str, Any]) -> Rule:
        # A flat or swapped store keeps one rule's fields: with any group with momentum, the
        # buffer's, which a group without momentum leaves untouched (as torch leaves one)
        store_rule = getattr(self, "_store_rule", None)
        if group["momentum"] != 0 or (store_rule is not None and store_rule.base is SGD_RULE):
            return SGD_RULE
        return SGD_PLAIN

    def store_rule(self) -> Rule:
        rule = SGD_RULE if any(g["momentum"] != 0 for g in self.param_groups) else SGD_PLAIN
        return rule.with_state_dtype(getattr(self, "state_dtype", "float32"))

    def group_hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(lr=to_float(group, "lr"), weight_decay=to_float(group, "weight_decay"),
                   maximize=bool(group.get("maximize", False)))
        if self.rule_of(group) is SGD_RULE:
            out.update(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                       nesterov=bool(group.get("nesterov", False)))
        return out

    def state_names(self):
        return (_BUF,)  # every group's, with or without momentum (momentum may change)

    def _started(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s momentum buffer started (torch: is not None)."""
        if getattr(self._store, "kind", None) == "host":
            return _BUF in self.state.get(p, ())
        return id(p) in self._buf_started

    def _store_step(self, work, multiplier: float) -> Dict[str, float]:
        before = self._buf_started
        kept = without_cleared(self, before, work)  # (a cleared param's buffer starts afresh, as in torch)
        if kept is not before:
            self._set_started(kept)
        batches = []
        for group, items in work:
            if group["momentum"] != 0 and group["dampening"] != 0:
                fresh = [it for it in items if not self._started(it[0])]
                if fresh:  # their buffers start as d_p, undamped (module docstring)
                    batches.append((self._hyper(dict(group, dampening=0.0), multiplier), fresh))
                    items = [it for it in items if self._started(it[0])]
            batches.append((self._hyper(group, multiplier), items))
        # before the step: its commit records the buffers started after it
        stepped = {id(p) for group, items in work if group["momentum"] != 0 for p, _ in items}
        if not stepped <= kept:
            self._set_started(kept | stepped)
        try:
            return store_step(self, batches)
        except BaseException:  # a step that failed (swap files at the step before): as before it
            if self._buf_started is not before:
                self._set_started(before)
            raise

    def _params_in_order(self) -> List[torch.Tensor]:
        return self._all_params()

    def _torch_state_layout(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        """torch's layout: ``{"momentum_buffer": tensor}`` per param whose buffer started
        (state_io.state_dict_of calls it before the post hooks)."""
        # a param that never stepped with momentum has no buffer in torch (a flat store keeps
        # an untouched one for it); the others have their buffer and no "step"
        params = self._params_in_order()
        # bf16 states (and a bf16 param that is its own master) round stochastically with seeds
        # of the step count (quant.rounding_seed): each param that stepped keeps its "step"
        # then, so that an optimizer loading this dict goes on with the same bits (torch's SGD
        # carries the extra key along, unused; a "step" alone starts no buffer, load_state_dict
        # below); float32 states keep torch's exact layout
        keep_step = self.state_dtype == "bfloat16" or self.master_dtype == "bfloat16"
        state = {}
        for k, st in sd["state"].items():
            if not (isinstance(k, int) and 0 <= k < len(params) and isinstance(st, dict)):
                state[k] = st  # not a param's entry (a hook's note): as torch passes it
                continue
            unborn = not self._started(params[k])
            entry = {key: v for key, v in st.items() if key != "step" and not (key == _BUF and unborn)}
            if keep_step and "step" in st:
                entry["step"] = st["step"]
            if entry:  # (a bf16 param keeps its fp32 "master", ours)
                state[k] = entry
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's layout (or ours): a ``None`` buffer is dropped, a sparse one (torch's, after
        sparse grads) loads as its dense equivalent, and an entry without a ``"step"`` counts
        one step taken (its buffer, if any, is not started afresh)."""
        # (a param this rank holds no slice of keeps its buffer started: the owner loads it)
        held_elsewhere = self._unheld_holes(state_dict)
        state_dict = self.loadable_form(state_dict)
        started = {k for k, st in state_dict["state"].items() if isinstance(st, dict) and _BUF in st} \
            if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict) else set()
        started |= held_elsewhere
        super().load_state_dict(state_dict)
        # torch pairs the saved groups' param ids with ours, in order
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        self._set_started({id(p) for k, p in zip(saved, self._params_in_order()) if k in started})
        record_now(self._store)
        attach_state_views(self)  # (attached by the load before the started buffers were known)

    def loadable_form(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` (torch's layout or ours) in ours, as :meth:`load_state_dict` loads it:
        each entry with its "step" (state_io.check_loadable's form; a stage 3 checkpoint checks
        it before its params change: offload/shard/checkpoint.py)."""
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)):
            return state_dict
        state = {}
        mine = self._loaded_params(state_dict)
        for k, st in state_dict["state"].items():
            if isinstance(st, dict):
                self._refuse_lost_buffer(k, st, mine.get(k))
                # (a "step" that is {}: what torch.distributed.checkpoint's unflatten
                # gives for a key of opt.state[p] the flattened dict lacks, and ours holds
                # a "step" there that torch's SGD layout drops: absent, as in that layout;
                # torch's buffer of a param with sparse grads is sparse: ours is its dense equivalent)
                st = {key: v.to_dense() if key == _BUF and isinstance(v, torch.Tensor) and v.is_sparse else v
                      for key, v in st.items()
                      if not (key == _BUF and v is None) and not (key == "step" and _is_hole(v))}
                st.setdefault("step", 1.0)
            state[k] = st
        return dict(state_dict, state=state)

    def _loaded_params(self, state_dict: Dict[str, Any]) -> Dict[Any, torch.Tensor]:
        """The dict's param ids -> ours, as torch pairs them (empty for a malformed dict:
        the checks of the load say what is wrong with it)."""
        try:
            return id_map(self, state_dict)
        except ValueError:
            return {}

    def _unheld_holes(self, state_dict: Any) -> set:
        """The keys of ``state_dict``'s entries that are :meth:`_unheld_hole` s."""
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)):
            return set()
        mine = self._loaded_params(state_dict)
        return {k for k, st in state_dict["state"].items() if isinstance(st, dict) and self._unheld_hole(st, mine.get(k))}

    def _unheld_hole(self, st: Dict[str, Any], p: Any) -> bool:
        """A "step" hole without a buffer for a param whose buffer started here and whose states
        this rank does not hold (stage 1/2: no slice of p, so ``opt.state[p]`` lists no buffer
        and the flattened dict's buffer was left out): nothing is lost, the owner loads it."""
        held = self.state.get(p) if p is not None else None
        return (_is_hole(st.get("step")) and _BUF not in st and isinstance(held, SwappedEntry)
                and not held.holds() and self._started(p))

    def _refuse_lost_buffer(self, k: Any, st: Dict[str, Any], p: Any) -> None:
        """A "step" hole ({}) marks an entry torch.distributed.checkpoint rebuilt from the
        keys of ``opt.state[p]`` (flatten_optimizer_state_dict=True): a started buffer those
        keys did not list (offload="nvme" before state_entry.py listed the swapped states) is
        lost, not absent: refused, as it cannot be told from a new one."""
        if (p is None or not _is_hole(st.get("step")) or _BUF in st or not self._started(p)
                or _BUF in self.state.get(p, ()) or self._unheld_hole(st, p)):
            return
        raise ValueError(f"load_state_dict: state[{k}] lost its {_BUF!r}: the dict was rebuilt from the keys of "
                         f"opt.state[p] (torch.distributed.checkpoint, flatten_optimizer_state_dict=True) without it: "
                         f"use flatten_optimizer_state_dict=False")

    def checkpoint_meta(self) -> Dict[str, Any]:
        """The params whose buffer started ([Note: kept states in checkpoints] in
        ckpt_holding.py): a checkpoint holds a buffer for every param that stepped."""
        return holding_of(_BUF, self._params_in_order(), {id(p) for p in self._params_in_order() if self._started(p)})

    def load_checkpoint(self, directory: str) -> None:
        """As :meth:`RuleOptimizer.load_checkpoint`; the buffers that started are those the
        meta lists (a buffer kept while its group's momentum is 0 too, as torch keeps it), or
        (a checkpoint written before it said) those of the params of a group with momentum
        that stepped."""
        params = self._params_in_order()
        held = saved_holding(directory, _BUF, len(params))  # (checked before anything loads)
        super().load_checkpoint(directory)
        started = self._started_by_steps() if held is None else {
            id(params[i]) for i in held if self._ctx.steps.get(params[i]) > 0}
        self._set_started(started)
        record_now(self._store)
        if getattr(self._store, "kind", None) != "host":
            attach_state_views(self)  # (attached by the load before the started buffers were known)
            return
        for p in params:  # it loaded a buffer for every param that stepped
            if id(p) not in started and p in self.state:
                self.state[p].pop(_BUF, None)
