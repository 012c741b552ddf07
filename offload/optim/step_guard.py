"""What makes a step all-or-nothing, or else a stated failure: checks before any change,
Ctrl-C held until the step is whole, and the failed state that refuses further steps.

[Note: failed steps] A step first checks every param and grad against what the optimizer
was built with (``check_work``): nothing has changed when that raises, and it is not a
failure. Past that point the step changes states in place, sub-group by sub-group. A
Ctrl-C in the main thread is held until the step is done (a second one interrupts at once).
Any exception that still escapes the store's step is a *failed step*, unless the store
says it put everything back (an I/O error of a store whose fp32 master is its own:
``mark_consistent``). After a failed step the step counts are those of the previous step,
``opt.step()`` refuses with the failure's text, and training goes on only through a public
call: ``opt.clear_failure()`` (params checked against the swap manifest's fingerprint, or
``accept_params=True``), ``load_state_dict()`` / ``load_checkpoint()`` (every state
replaced), or ``close(keep_swap=True)`` and a new optimizer with ``resume=True``.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload.memory import paging
from offload.optim.protocol import optional
from offload.optim.state_versions import bump
from offload.swap import cleanup
from offload.swap.sigint import sigint_held

__all__ = ["ParamSig", "canonical_sig", "snapshot", "check_work", "defer_sigint", "gc_paused", "mark_consistent", "is_consistent",
           "failure_text", "store_step", "mark_written", "clear_failure"]

# What a param was when the optimizer was built: its states are laid out for exactly this.
ParamSig = Tuple[Tuple[int, ...], torch.dtype, torch.device]

_CONSISTENT = "_offload_step_consistent"


_CPU = torch.device("cpu")


def snapshot(params: Sequence[torch.Tensor]) -> Dict[int, Tuple[int, ParamSig]]:
    """id(param) -> (index, (shape, dtype, device)) of the params as registered (a CPU
    param's device is ``_CPU`` itself, which ``check_work`` tells by identity)."""
    return {id(p): (i, canonical_sig((tuple(p.shape), p.dtype, p.device))) for i, p in enumerate(params)}


def canonical_sig(sig: ParamSig) -> ParamSig:
    """``sig`` with a CPU device as ``_CPU`` itself (an unpickled one is another object)."""
    shape, dtype, device = sig
    return (shape, dtype, _CPU) if device == _CPU else sig


def _describe(sig: ParamSig) -> str:
    shape, dtype, device = sig
    return f"{str(dtype).replace('torch.', '')} {list(shape)} on {device}"


def _check_param(p: torch.Tensor, sigs: Dict[int, Tuple[int, ParamSig]]) -> int:
    entry = sigs.get(id(p))
    if entry is None:
        raise ValueError(f"a tensor of shape {list(p.shape)} in param_groups is not one this optimizer was "
                         "built with (assigning new tensors to param_groups[...]['params'] is not supported: "
                         "use add_param_group, or build a new optimizer)")
    i, sig = entry
    now = (tuple(p.shape), p.dtype, p.device)
    if now != sig:
        raise ValueError(f"param {i} was registered as {_describe(sig)} and is now {_describe(now)}: the "
                         "optimizer's states are laid out for the registered params; build a new optimizer "
                         "after changing a param's dtype, size or device")
    return i


def _refuse_meta(i: int, group: Any) -> None:
    """[Note: params on the meta device] A param built on the meta device (a model made under
    ``torch.device("meta")``) has no values. The optimizer takes it, as torch's do (the host
    store keeps nothing per param until a step), but refuses to step it, before anything
    changes: torch's fused path raises the same way (its message, where the group asked for
    ``fused=True``), and its for-loop would step nothing at all. ``module.to_empty()`` makes new
    params: build the optimizer over those."""
    where = (f"param {i} is on the meta device (no values to step): materialize the model "
             "(module.to_empty(device=...), then its init or a load) and build the optimizer over its new params")
    if isinstance(group, dict) and group.get("fused"):
        raise RuntimeError(f"`fused=True` requires all the params to be floating point Tensors of supported devices: "
                           f"['cpu', 'cuda']; {where}")
    raise RuntimeError(where)


def _check_grad(i: int, p: torch.Tensor, g: Any, sparse_message: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"param {i}: grad is a {type(g).__name__}, not a tensor")
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(sparse_message)
    if g.dtype != p.dtype or tuple(g.shape) != tuple(p.shape) or g.device != p.device:
        raise TypeError(f"param {i}: grad is {_describe((tuple(g.shape), g.dtype, g.device))}, the param "
                        f"{_describe((tuple(p.shape), p.dtype, p.device))}; a grad must match its param's "
                        "dtype, shape and device")


def check_work(work: Sequence[Tuple[Any, List[Tuple[torch.Tensor, Any]]]],
               sigs: Dict[int, Tuple[int, ParamSig]],
               sparse_message: str = "Adam does not support sparse gradients, please consider SparseAdam instead") -> None:
    """Raise before the step changes anything if a param is no longer what it was registered
    as, or its grad does not fit it (a store's own stand-in for a grad held on another rank,
    which is not ``p.grad``, is the store's to check), or a param on NVMe was written past
    its swap file (offload/shard/tier_writes.py)."""
    strided, cpu = torch.strided, _CPU
    for group, items in work:
        for p, g in items:
            # the common case, CPU params, in a few attribute reads (this runs per param per
            # step; a device's .type alone costs 0.25 us); anything else goes through the full
            # checks, which raise with the whole story
            entry = sigs.get(id(p))
            sig = None if entry is None else entry[1]
            if sig is None or sig[2] is not cpu or p.dtype is not sig[1] or p.shape != sig[0] or not p.is_cpu:
                i = _check_param(p, sigs)
                if p.is_meta:
                    _refuse_meta(i, group)
                if g is p.grad:
                    _check_grad(i, p, g, sparse_message)
            elif g is p.grad and (g.layout is not strided or g.dtype is not p.dtype or g.shape != p.shape
                                  or not g.is_cpu):
                _check_grad(entry[0], p, g, sparse_message)
    if paging.active():
        paging.check([p.detach() for _, items in work for p, _ in items])


@contextlib.contextmanager
def defer_sigint() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT with Python's default handler, main thread only) until the
    block ends, then raise KeyboardInterrupt; a second Ctrl-C raises at once. Also wraps a
    SIGTERM handler set since the swap stores opened (swap/cleanup.py watch_sigterm)."""
    cleanup.watch_sigterm()
    with sigint_held():
        yield


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """[Note: no collection inside a step] A step makes a few short-lived objects per param
    (work items, packed structs, undo records); with thousands of params, collections fired
    in the middle of the step find them alive and promote them, and Python's full
    collections, each over every object of the process (~300K with torch loaded), then come
    every few steps: 13.6 ms of a 44 ms step over 2000 small params (twenty-eighth session,
    bench/model_step.py "small"). Paused for the step, they die uncollected by refcount and
    nothing is promoted. A collector the user disabled stays disabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def mark_consistent(exc: BaseException) -> BaseException:
    """Say that the store put every state and param back at the previous step before raising
    ``exc``: the same step can be retried and the optimizer does not enter the failed state."""
    setattr(exc, _CONSISTENT, True)
    return exc


def is_consistent(exc: BaseException) -> bool:
    return bool(getattr(exc, _CONSISTENT, False))


def failure_text(exc: BaseException, store_kind: str, held: Optional[str] = None, cause: bool = True) -> str:
    """Why steps are refused after ``exc`` ended a step (``held``: what holds which step, when
    the store knows better; ``cause=False``: without ``exc``'s own text), and the public ways on."""
    what = getattr(exc, "strerror", None) if isinstance(exc, OSError) else None
    what = f"{type(exc).__name__}: {what or exc}" if str(exc) or what else type(exc).__name__
    if store_kind == "nvme":
        held = held or ("the swap files and step counts hold the previous step; the fp32 params of the "
                        "sub-groups already computed were updated in place")
        ways = ("restore them (your own checkpoint of that step) and call opt.clear_failure(), which checks "
                "them against the swap manifest; or opt.clear_failure(accept_params=True) to go on from the "
                "params as they are (the elements already updated get this step's update once more when it is retried); or opt.load_checkpoint(); "
                "or opt.close(keep_swap=True) and a new optimizer with resume=True and the restored params")
    elif store_kind == "flat-nvme":
        # The swap commit is atomic: the swap files hold the previous step, or (interrupted after
        # the commit) this one, and a resume rebuilds the params from their masters either way.
        held = held or ("the swap files hold a whole step (masters and moments), but some params may "
                        "already have been updated")
        ways = ("opt.close(keep_swap=True) and a new optimizer with resume=True over the same params (it "
                "rewrites them from the swapped masters), or opt.load_state_dict() / opt.load_checkpoint() "
                "with your checkpoint, or opt.clear_failure(accept_params=True) to go on from the states as "
                "they are")
    else:
        held = held or ("the step counts hold the previous step, but some params and their moments may "
                        "already have been updated in place")
        ways = ("opt.load_state_dict() / opt.load_checkpoint() with your checkpoint (and your params of that "
                "step), or opt.clear_failure(accept_params=True) to go on from the states as they are")
    text = f"{held}. Further steps are refused until you {ways}"
    return f"a step failed ({what}): {text}" if cause else text


def store_step(opt: Any, work: Sequence[Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]]) -> Dict[str, float]:
    """Count the step (``ctx.steps``, the one place the counts live) and let the store apply
    it (``work``: per group, its AdamHyper and (param, grad) pairs); each work item carries
    its param's new count. Any failure restores the counts and, unless the store put
    everything back, enters the failed state.

    [Note: writes before the counts] States written since the last step and not yet in the
    swap files (write_state: Adagrad's initial ``sum``, an assigned ``opt.state[p][k]``, a
    restarted param) are committed before the counts advance: that commit records the counts
    with the states, and made inside the store's step (as it was) it paired the step's new
    counts with the old states, so a kill -9 before the step's own commit left a manifest one
    step ahead of its data, and resume=True went on from it (every Adagrad run's first step
    with offload="nvme"; found by a failing-environment sweep, thirty-third session)."""
    bump(opt._store)  # copies read before are stale, even if the step fails ([Note: state versions])
    try:
        return _store_step(opt, work)
    finally:
        bump(opt._store)  # (and those read during it, by a hook)


def _store_step(opt: Any, work: Sequence[Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]]) -> Dict[str, float]:
    steps = opt._ctx.steps
    batches: List[Any] = []
    before: List[Tuple[torch.Tensor, Any]] = []
    # as torch: a param whose state the user cleared starts afresh (also one this step does not
    # reach: [Note: cleared before a save] in state_io.py)
    from offload.optim.state_io import restart_all_cleared

    restart_all_cleared(opt)
    commit = optional(opt._store, "commit_writes")
    try:
        if commit is not None:  # [Note: writes before the counts]
            commit()
        for hyper, items in work:
            undo, counts = steps.advance(p for p, _ in items)
            before += undo
            batches.append((hyper, [(p, g, n) for (p, g), n in zip(items, counts)]))
        phases = dict(opt._store.step(batches))
    except BaseException as exc:
        # The states (swap files, or what the store put back) are at the previous step: so
        # are the counts, or a retry would use the bias correction of a step that never happened.
        steps.restore(before)
        if not is_consistent(exc):
            kind = "flat-nvme" if getattr(opt._store, "_swap", None) is not None else opt._store.kind
            opt._failure = getattr(opt._store, "_broken", None) or failure_text(exc, kind)
        raise
    mark_written(opt._store, batches)
    return phases


def mark_written(store: Any, batches: Sequence[Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor, int]]]]) -> None:
    """[Note: stepped params are marked written] Each stepped param's ``_version`` goes up by
    one, as torch's in-place ``p.add_`` bumps it; the kernels and copies that wrote it read
    and write through pointers, which torch cannot count. Two things need it: autograd's
    check (a backward through a graph that saved a param from before the step raises
    "modified by an inplace operation", as with torch's optimizers, instead of computing
    with the new values) and [Note: params written by others] in flat/param_sync.py (a
    second optimizer over the same params sees this one's update, where it stepped from its
    own master and overwrote it). The store then records the versions (``params_written``),
    so it does not take its own write for another's. Stage 3 shards are not marked: their
    pager tracks versions of its own ([Note: writes past the pager] in shard/tier_writes.py),
    and forward never reads them."""
    params = [p for _, items in batches for p, _, _ in items if getattr(p, "_offload_shard", None) is None]
    if params:
        torch.autograd.graph.increment_version(params)
    written = optional(store, "params_written")
    if written is not None:
        written()


def clear_failure(opt: Any, accept_params: bool) -> None:
    """``opt.clear_failure()``: see its docstring and [Note: failed steps]."""
    if not getattr(opt, "_failure", None):
        return
    bump(opt._store)  # (a restore writes the states back)
    clear = getattr(opt._store, "clear_failure", None)
    if clear is not None:
        clear(accept_params=accept_params)
    elif not accept_params:
        raise ValueError("this store cannot check which states the failed step changed: load your checkpoint "
                         "(load_state_dict / load_checkpoint), or clear_failure(accept_params=True) to go on "
                         "from the states as they are")
    opt._failure = None
