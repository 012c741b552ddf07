"""``state_dict()`` and ``load_state_dict()`` of every offload optimizer over any store
(the state names are its rules' fields: ``opt.state_names()``).

``state_dict`` reads the states from the store into a new dict in torch's layout (float32
states, compressed ones decoded: state_codec.py) and changes nothing in the optimizer (torch's ``Optimizer.state_dict`` hands out the very dicts
of ``opt.state``: merging into them would leave stale copies of the moments in RAM).

``load_state_dict`` is all or nothing: the whole dict is checked first (``check_loadable``:
group and param counts, every entry's moments, master and step against its param), so a bad
dict raises with the optimizer unchanged; a swap store then writes every loaded state into
its free slots and commits once (``atomic_writes``), so a kill -9 in the middle leaves the
swap directory at the states before the load, never a mix of two.
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from itertools import chain
from typing import Any, Callable, Dict, List, Set

import torch

from offload.kernels.fields import LATE_STATES
from offload.optim.guards import before_load
from offload.optim.options import check_group_values, check_loaded_groups, loaded_group_rule
from offload.optim.protocol import optional
from offload.optim.state_view import MASTER, attach, seen_names
from offload.shard.dcp_chunks import mark_param_states, unmarked

__all__ = ["state_dict_of", "unused_names", "load_state_dict_into", "check_loadable", "restart_cleared",
           "restart_all_cleared", "id_map"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's states: the names of an optimizer without ``state_names()`` (a store's own tests)."""


def names_of(opt: Any) -> tuple:
    """The per-element state names of ``opt``'s rules (``RuleOptimizer.state_names``)."""
    names = getattr(opt, "state_names", None)
    return tuple(names()) if names is not None else MOMENTS


def unused_names(opt: Any, group: Dict[str, Any], p: torch.Tensor) -> Set[str]:
    """The states a store keeps for ``p`` (of ``group``) that torch's would not hold (a plain
    Adam group's max_exp_avg_sq in a store of amsgrad groups too): not torch's to see."""
    names = names_of(opt)
    return set(names) - set(seen_names(opt, group, p, names))


def state_dict_of(opt: Any, base: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``base()`` is torch's ``Optimizer.state_dict``; its post hooks run here, on the full dict."""
    hooks = opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_post_hooks = OrderedDict()
    try:
        sd = base()
    finally:
        opt._optimizer_state_dict_post_hooks = hooks
    export = getattr(opt._store, "export_state", None)
    if getattr(opt._store, "kind", None) == "host" and getattr(opt._store, "state_dtype", "float32") != "float32":
        sd["state"] = _host_torch_layout(opt, sd["state"], export)
    elif getattr(opt._store, "kind", None) == "host":  # new entry dicts, holding the very tensors
        sd["state"] = {k: dict(v) if isinstance(v, dict) else v for k, v in sd["state"].items()}
    elif getattr(opt._store, "kind", None) != "host":
        # New entry dicts (the ones torch returns are opt.state's own), without the views
        # into the store's buffers that state_view.attach put there: full tensors instead.
        # (An entry that held nothing else, e.g. after load_checkpoint set its step to 0, goes.)
        # (A value that is not a dict, e.g. what a pre hook put in ``opt.state["note"]``,
        # passes through as torch's state_dict passes it.)
        names = names_of(opt) + MASTER  # (the master's view too: [Note: the master in opt.state])
        # (dict.items: an entry's states read on access are not read only to be dropped)
        sd["state"] = {k: {key: t for key, t in dict.items(v) if key not in names} if isinstance(v, dict) else v
                       for k, v in sd["state"].items()
                       if not isinstance(v, dict) or set(dict.keys(v)) - set(names) or not dict.__len__(v)}
        index = 0
        for group in opt.param_groups:
            for p in group["params"]:
                unused = unused_names(opt, group, p)  # [Note: groups of different rules] in kernels/fields.py
                exported = {k: v for k, v in export(p).items() if k not in unused}
                if exported:
                    sd["state"].setdefault(index, {}).update(exported)
                index += 1
    # The rule's own differences from the stores' layout (SGD's unstarted buffers, Adagrad's
    # unstepped sums), before the hooks: a post hook sees and returns torch's layout.
    layout = getattr(opt, "_torch_state_layout", None)
    if layout is not None:
        sd = layout(sd)
    if getattr(opt, "stage", None) == 3:  # each rank's chunk for DCP ([Note: shards in DCP])
        params = [p for g in opt.param_groups for p in g["params"]]
        sd["state"] = {k: mark_param_states(v, params[k])
                       if isinstance(v, dict) and isinstance(k, int) and 0 <= k < len(params) else v
                       for k, v in sd["state"].items()}
    for hook in list(hooks.values()):
        out = hook(opt, sd)
        if out is not None:
            sd = out
    return sd


def _host_torch_layout(opt: Any, state: Dict[Any, Any], export: Callable) -> Dict[Any, Any]:
    """The host store's entries (torch's own dicts, holding the states as stored: bf16 or
    packed int8) as new dicts in torch's layout, float32 states of the param's shape, in the
    same key order (state_codec.py)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {}
    for k, entry in state.items():
        if not isinstance(entry, dict):  # not a param's (a hook's note): as torch passes it
            out[k] = entry
            continue
        exported = export(params[k]) if isinstance(k, int) and 0 <= k < len(params) else {}
        out[k] = {key: exported.get(key, v) for key, v in entry.items()}
    return out


def id_map(opt: Any, state_dict: Dict[str, Any]) -> Dict[Any, torch.Tensor]:
    """Saved param ids -> this optimizer's params, as torch's load_state_dict pairs them."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
            or not isinstance(state_dict.get("state"), dict):
        raise ValueError("load_state_dict: expected a dict with 'state' (a dict) and 'param_groups' (a list)")
    groups, saved = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for g, s in zip(groups, saved):
        if not isinstance(s, dict) or not isinstance(s.get("params"), (list, tuple)) \
                or len(g["params"]) != len(s["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
    return dict(zip(chain.from_iterable(s["params"] for s in saved),
                    chain.from_iterable(g["params"] for g in groups)))


def _check_step(k: Any, step: Any) -> None:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"load_state_dict: state[{k}]['step'] has {step.numel()} elements, expected 1")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) \
            or step < 0 or step != int(step):
        raise ValueError(f"load_state_dict: state[{k}]['step'] is {step!r}, expected a whole number >= 0")


def _check_entry(k: Any, p: torch.Tensor, st: Any, names: tuple, required: tuple) -> None:
    """``names``: every state the optimizer's rules keep (each present one is checked);
    ``required``: those of the rule the entry's group steps with (all or none present)."""
    if not isinstance(st, dict):
        raise ValueError(f"load_state_dict: state[{k}] is a {type(st).__name__}, expected a dict")
    present = [key for key in names if key in st]
    held = [key for key in required if key in st]
    # (a state that starts late, amsgrad's, may be missing beside the others: fields.LATE_STATES)
    missing = [key for key in required if key not in st and key not in LATE_STATES]
    if held and missing:
        raise ValueError(f"load_state_dict: state[{k}] has {held[0]!r} without {missing[0]!r}")
    if present and "step" not in st:
        raise ValueError(f"load_state_dict: state[{k}] has moments but no 'step'")
    if "step" in st:
        _check_step(k, st["step"])
    for key in present + (["master"] if "master" in st else []):
        t = st[key]
        if not isinstance(t, torch.Tensor) or t.is_sparse or not (t.dtype == torch.complex64 if p.is_complex()
                                                                   else t.is_floating_point()):
            kind = "complex64" if p.is_complex() else "floating-point"  # as the param: [Note: complex params]
            raise ValueError(f"load_state_dict: state[{k}][{key!r}] is not a dense {kind} tensor")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"load_state_dict: state[{k}][{key!r}] has shape {list(t.shape)}, its param "
                             f"{list(p.shape)}")


def _check_not_bare(k: Any, st: Any, required: tuple, held: Any) -> None:
    """An entry with a step count > 0 and none of the states its rule steps with, for a param
    whose states this rank holds (``held``: its ``opt.state`` entry): the load would start
    them afresh under the loaded count, silently (torch's Adam fails at its next step,
    KeyError 'exp_avg'). Such a dict comes from torch.distributed.checkpoint's
    ``set_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``: it rebuilds each
    entry from the keys of ``opt.state[p]``, so a state left out of them (as the swapped ones
    were before state_entry.py listed them) is dropped. A rank that holds none of ``p`` (stage
    1/2: no view there) loses nothing: it loads as before. ``held`` is asked by ``in`` and,
    for a plain dict only, its value (SGD's None buffer): a swapped entry's value is a disk read."""
    if not (isinstance(st, dict) and required and "step" in st) or any(key in st for key in required):
        return
    step = st["step"]
    if float(step.item() if isinstance(step, torch.Tensor) else step) <= 0:
        return
    if isinstance(held, dict) and any(key in held and (type(held) is not dict or held[key] is not None)
                                      for key in required):
        raise ValueError(f"load_state_dict: state[{k}] has a 'step' ({float(step):g}) but none of "
                         f"{list(required)}, which this optimizer holds: they would start afresh (torch's optimizer "
                         "fails at its next step); a dict of torch.distributed.checkpoint's set_optimizer_state_dict: "
                         "try flatten_optimizer_state_dict=False")


def check_loadable(opt: Any, state_dict: Dict[str, Any]) -> None:
    """Raise (ValueError) before anything is loaded if any part of ``state_dict`` cannot be."""
    check_loaded_groups(opt, state_dict)
    ours = id_map(opt, state_dict)
    names = names_of(opt)
    # each entry against the rule of its group in the dict (torch's load takes the dict's
    # groups: with amsgrad in some groups only, the others hold no max_exp_avg_sq)
    required: Dict[Any, tuple] = {}
    for theirs in state_dict["param_groups"]:
        rule = loaded_group_rule(opt, theirs)
        for k in theirs["params"]:
            required[k] = rule.names if rule is not None else names
    for k, st in state_dict["state"].items():
        p = ours.get(k)
        if p is not None:
            _check_entry(k, p, st, names, required.get(k, names))
            if not getattr(opt, "BARE_STEP_STARTS_AFRESH", False):
                _check_not_bare(k, st, required.get(k, names), opt.state.get(p))


def _wrapped(v: Any) -> bool:
    """A tensor of a subclass that wraps its values (not a Parameter; not a DTensor, whose
    values are spread over ranks: torch's load keeps it, as here)."""
    return (isinstance(v, torch.Tensor) and type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter)
            and type(v).__name__ != "DTensor")


def _plain(where: str, v: Any) -> Any:
    if not _wrapped(v):
        return v
    out = torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device)
    try:
        out.copy_(v.detach())
    except (NotImplementedError, RuntimeError, TypeError) as exc:
        raise ValueError(f"load_state_dict: {where} is a {type(v).__name__} whose values cannot be copied out "
                         f"({exc}); load a dict of plain tensors") from None
    return out


def plain_states(state_dict: Any) -> Any:
    """``state_dict`` with each state tensor of a wrapping subclass replaced by the plain
    tensor its own ``copy_`` gives. torchao's AdamW8bit state_dict holds ``OptimState8bit``
    states, whose other ops are not implemented: the host stores' load failed inside the
    int8 encode (``aten.eq``), or kept them in ``opt.state`` with float32 states, where the
    step then refused them ("exp_avg_sq overlaps exp_avg in memory": both data pointers 0)."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict) or not any(_wrapped(v) for st in state.values() if isinstance(st, dict)
                                              for v in st.values()):
        return state_dict
    return dict(state_dict, state={k: ({n: _plain(f"state[{k!r}][{n!r}]", v) for n, v in st.items()}
                                       if isinstance(st, dict) else st) for k, st in state.items()})


def load_state_dict_into(opt: Any, state_dict: Dict[str, Any], base: Callable[[Dict[str, Any]], None]) -> None:
    """``base`` is torch's ``Optimizer.load_state_dict``: it replaces ``opt.state`` and
    ``opt.param_groups``, which are put back if the load fails after the checks."""
    state_dict = plain_states(unmarked(state_dict))  # a stage-3 dict's DCP chunks ([Note: shards in DCP])
    check_loadable(opt, state_dict)
    store = opt._store
    swap = store if hasattr(store, "atomic_writes") else getattr(store, "_swap", None)
    batch = swap.atomic_writes() if swap is not None else contextlib.nullcontext()
    old_state, old_groups = opt.state, opt.param_groups
    # the params that hold moments now, asked before torch's load replaces opt.state (the
    # step counts live there): only those need their moments zeroed when the dict has none
    held = {id(p) for p in opt._all_params() if opt._ctx.steps.get(p) > 0}
    # the last pre hook: the store keeps the tensors of the dict the user's hooks returned
    last_pre_hook = opt.register_load_state_dict_pre_hook(before_load)
    # the keys its own groups step with: torch's __setstate__ (each load) adds "differentiable"
    # to the defaults alone, so after one load of Lion's dict (which has none) the defaults
    # asked for a key no group of it holds, and it refused its own state_dict (forty-eighth session)
    need = [k for k in opt.defaults if all(k in g for g in opt.param_groups)]
    try:
        with batch:
            base(state_dict)
            _check_group_keys(opt, need)
            _check_group_values(opt)
            if getattr(store, "kind", None) != "host":
                _import_all(opt, store, held)
            elif hasattr(store, "settle"):
                store.settle()  # the loaded float32 states, encoded as state_dtype stores them
    except BaseException:
        opt.state, opt.param_groups = old_state, old_groups  # the step counts with them (ctx.steps)
        raise
    finally:
        last_pre_hook.remove()
        # the flat store's before_load keeps the loaded fp32 tensors for import_state: drop them
        end = optional(store, "end_load")
        if end is not None:
            end()
    if hasattr(store, "clear_failure"):
        store._broken = None  # every state was replaced: see step_guard [Note: failed steps]
    opt._ctx.steps.recount(opt._all_params())  # the loaded counts (restart_cleared)
    attach(opt)


def _check_group_keys(opt: Any, need: List[str]) -> None:
    """Every loaded group has each hyperparameter the optimizer's own groups have (the flags
    older torch releases lack were filled by ``__setstate__``). torch's load takes any groups
    and its step fails with a bare ``KeyError: 'betas'`` (an SGD or Adagrad state_dict loaded
    into AdamW); here the load fails and nothing changes."""
    for i, group in enumerate(opt.param_groups):
        missing = [k for k in need if k not in group]
        if missing:
            has = sorted(k for k in group if k != "params")
            raise ValueError(f"load_state_dict: param group {i} has no {', '.join(map(repr, missing))}, which "
                             f"offload.{type(opt).__name__} steps with (a state_dict of another optimizer? "
                             f"the group holds {has})")


def _check_group_values(opt: Any) -> None:
    """Each loaded group passes the constructor's checks (``options.check_group_values``):
    torch's load takes ``lr=None`` or ``betas=[]`` and its step fails; here each step failed
    too, after the states had been replaced."""
    for i, group in enumerate(opt.param_groups):
        try:
            check_group_values(opt, group, f"param group {i}")
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            raise ValueError(f"load_state_dict: {exc}; nothing was loaded") from None


def _import_all(opt: Any, store: Any, held: Set[int]) -> None:
    params: List[torch.Tensor] = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        st = opt.state.get(p) or {}
        moments = {k: st.pop(k) for k in names_of(opt) if dict.__contains__(st, k)}  # (torch's new dicts)
        if moments:
            # the states the param's group does not use (a plain Adam param in a store of
            # amsgrad groups too) start afresh: torch's dict holds none
            fill = _fills(opt)
            moments.update(_filled(p, {k: v for k, v in fill.items() if k not in moments}))
            store.import_state(p, moments)
        elif id(p) in held:
            # As torch: a param without state in the loaded dict starts afresh (zero
            # moments, step 0), not with the moments this optimizer held before.
            _start_afresh(opt, store, p)


def _fills(opt: Any) -> Dict[str, float]:
    """Each state's value at a fresh start (zeros; Adagrad's sum: initial_accumulator_value)."""
    return {k: float(opt.state_fill(k)) if hasattr(opt, "state_fill") else 0.0 for k in names_of(opt)}


def _filled(p: torch.Tensor, fill: Dict[str, float]) -> Dict[str, torch.Tensor]:
    return {k: torch.full_like(p, v, dtype=torch.float32) for k, v in fill.items()}


def _start_afresh(opt: Any, store: Any, p: torch.Tensor) -> None:
    fill = _fills(opt)
    if any(fill.values()):  # Adagrad's sum: torch starts it at initial_accumulator_value
        store.import_state(p, _filled(p, fill))
    else:
        store.reset_state(p)


def restart_cleared(opt: Any, params: List[torch.Tensor]) -> None:
    """``params``, whose state the user cleared since their last step (``del opt.state[p]``,
    ``opt.state[p].clear()``, a new ``opt.state``: their step counts went), start afresh as
    torch's would: the moments a store keeps outside ``opt.state`` go back to their initial
    values (zeros; Adagrad's initial_accumulator_value). The host store's went with the entry
    (``store_step`` does not look for them there)."""
    fill = _fills(opt)
    for p in params:  # import_state, not reset_state: the flat store's resets only within a load
        opt._store.import_state(p, _filled(p, fill))


def restart_all_cleared(opt: Any, commit: bool = False) -> List[torch.Tensor]:
    """``restart_cleared`` of every param whose state was cleared since its last step (not only
    those a step reaches); ``commit``: the restarted states are committed at once.

    [Note: cleared before a save] A clear() is seen at the next step (StepCounts.cleared), and
    the stores that keep the moments outside ``opt.state`` (flat, swapped) still held the
    cleared param's moments until then: ``save_checkpoint`` wrote them with step 0, and an
    ``offload="nvme"`` optimizer loading that checkpoint stepped on from them (max |diff|
    0.019 after one Adam step at lr 0.01, found by tools/history_fuzz.py). A step restarted
    only the params it stepped, so one cleared while frozen kept its moments in the swap files
    that a ``resume=True`` went on from. Both now restart every cleared param first."""
    if getattr(opt._store, "kind", None) == "host":
        return []  # (the host store's states went with the entry)
    cleared = opt._ctx.steps.cleared(opt._all_params())
    if cleared:
        restart_cleared(opt, cleared)
        opt._ctx.steps.restarted(cleared)  # not again at each step while it is frozen
        flush = optional(opt._store, "commit_writes") if commit else None
        if flush is not None:
            flush()
    return cleared
