"""Step pre-hooks that refuse a step the optimizer's layout no longer fits, and the load
hooks that hand torch's load to the store (``register_store_hooks``).

Both conditions arise after construction, outside the optimizer's view: the job gains ranks
(``torch.distributed`` initialised after the optimizer was built, as HF ``TrainingArguments``
does), or the user assigns new tensors to ``opt.param_groups[i]["params"]``. Either would
otherwise step silently with the wrong layout (every rank keeping all the states) or fail deep
inside a store with a bare ``KeyError``. They are hooks, registered in ``__init__``, so the
step itself stays as it is; module-level functions, so that an optimizer that can be pickled
still can.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Dict

import torch

from offload.optim.protocol import optional

__all__ = ["eager", "one_at_a_time", "register_guards", "register_store_hooks", "before_load", "step_sigs"]


def eager(fn):
    """``torch.compiler.disable`` applied lazily, as torch's own optimizers do
    (``torch._disable_dynamo``): the decorator itself would import torch._dynamo when this
    module is imported (about 1 s and 70 MiB of RSS on `import offload`); torch imports it
    anyway at the first ``add_param_group`` of any optimizer."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


_STEPPING: Dict[int, int] = {}  # id(optimizer) -> the thread in its step()
_STEPPING_LOCK = threading.Lock()


def _forget_steps_in_child() -> None:  # a forked child has only the thread that forked
    global _STEPPING_LOCK
    _STEPPING.clear()
    _STEPPING_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_steps_in_child)


def one_at_a_time(step):
    """``step`` refusing to start while the same optimizer steps in another thread (or in
    this one: a closure that calls ``step()``). Two threads in one swap step both read the
    same committed states and each commits its own update: 11 calls from two threads left
    the step count at 9 or 10, silently. torch's optimizers race the same way without a
    word; a step that changes files and step counts raises instead. The registry is a
    module-level dict, not a lock on the optimizer, so an optimizer that can be copied or
    pickled still can."""
    @functools.wraps(step)
    def guarded(self, *args, **kwargs):
        me = threading.get_ident()
        with _STEPPING_LOCK:
            other = _STEPPING.get(id(self))
            if other is None:
                _STEPPING[id(self)] = me
        if other is not None:
            where = "in this thread (a closure that calls step()?)" if other == me else f"in thread {other}"
            raise RuntimeError(f"{type(self).__name__}.step() is already running {where}: one optimizer steps "
                               "in one thread at a time; step it from one thread, or hold a lock around step()")
        try:
            return step(self, *args, **kwargs)
        finally:
            with _STEPPING_LOCK:
                _STEPPING.pop(id(self), None)
    return guarded


def register_guards(opt: torch.optim.Optimizer) -> None:
    opt.register_step_pre_hook(check_world)
    opt.register_step_pre_hook(check_params)


def register_store_hooks(opt: torch.optim.Optimizer) -> None:
    """The optimizer's load_state_dict hooks that hand torch's load to the store (its
    ``after_load``, when it has one): the optimizer registers them, so the store never
    touches the optimizer. Registered right after the store is built, before any hook of the
    user's, so they run first, as the store's own hooks did. ``before_load`` is registered by
    each load instead (state_io.load_state_dict_into), after the user's pre hooks: it keeps
    the loaded tensors, which must be those of the dict a user's hook returned."""
    opt.register_load_state_dict_post_hook(after_load)
    opt.register_step_post_hook(after_step)


def after_step(opt: Any, args: Any, kwargs: Any) -> None:
    """The step consumed the grads backward released to the host ([Note: releasing grads] in
    offload/optim/flat/grads.py; a skipped step too): the next backward starts afresh."""
    drop = optional(opt._store, "drop_released_grads")
    if drop is not None:
        drop()


def before_load(opt: Any, state_dict: Any) -> None:
    hook = optional(opt._store, "before_load")
    if hook is not None:
        hook(state_dict, opt._all_params())


def after_load(opt: Any) -> None:
    hook = optional(opt._store, "after_load")
    if hook is not None:
        hook()


@eager
def check_world(opt: Any, args: Any, kwargs: Any) -> None:
    """An optimizer that chose stage 0 because it was alone must not step with several ranks."""
    if not getattr(opt, "_stage_auto_single", False):
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(opt._process_group)
    if world > 1:
        raise RuntimeError(
            f"{type(opt).__name__} was built before torch.distributed was initialised, so it chose "
            f"stage 0 (every rank keeps all the fp32 states), but this job now has {world} ranks: build "
            "the optimizer after init_process_group() (it then partitions the states, stage 2), or pass "
            "stage=0 to keep the full states on every rank on purpose")


@eager
def check_params(opt: Any, args: Any, kwargs: Any) -> None:
    """The params in ``param_groups`` must be those the store laid out its states for."""
    from offload.optim.host_state import HostState

    if isinstance(opt._store, HostState):
        return  # states keyed by the param itself, in opt.state, as torch's: any fp32 CPU param works
    registered = opt._registered
    current = opt._all_params()
    same = len(current) == len(registered) and all(a is b for a, b in zip(current, registered))
    if not same:
        kind = getattr(opt._store, "kind", "store")
        if len(current) == len(registered) and {id(p) for p in current} == {id(p) for p in registered}:
            raise RuntimeError(
                f"{type(opt).__name__}: opt.param_groups holds the same {len(current)} params in another order "
                f"(param groups or params within a group reordered); the {kind} store laid out its fp32 states "
                "in the order they were given: put them back in that order")
        raise RuntimeError(
            f"{type(opt).__name__}: opt.param_groups no longer holds the params this optimizer was built "
            f"with ({len(registered)} registered, {len(current)} now; the {kind} "
            "store laid out its fp32 states for those): add new params with add_param_group(), or build a "
            "new optimizer for the new params")


def step_sigs(opt: Any) -> Any:
    """What ``step_guard.check_work`` checks the params against. The host store keys its
    states by the param itself (as torch), so a param put into ``param_groups`` after
    construction is taken as it is at its first step (``check_params`` lets it through), once
    the store accepts it (fp32, CPU); registered params are still held to what they were.
    The ids cannot be those of dead params: ``opt._registered`` holds every registered one."""
    from offload.optim.host_state import HostState

    if not isinstance(opt._store, HostState):
        return opt._param_sigs
    registered = opt._param_sigs
    added = [(i, p) for i, p in enumerate(opt._all_params()) if id(p) not in registered]
    if not added:  # the usual case: no copy of the registered signatures (check_work only reads them)
        return registered
    sigs = dict(registered)
    for i, p in added:
        opt._store.check_param(i, p)
        sigs[id(p)] = (i, (tuple(p.shape), p.dtype, p.device))
    return sigs
