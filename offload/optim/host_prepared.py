"""The host store's fast path: a param group stepped through its kept native structs.

[Note: prepared batches] in offload/kernels/native_prepared.py says what is kept and why.
This module decides when the kept structs may run: a group's float32 part, on the native
backend, whose params and states are where and what they were when the structs were packed
(same addresses and sizes, still contiguous: ``_signature``), with float32 contiguous grads
of the params' sizes. Anything else (a state replaced or cleared, ``p.data`` reassigned, a
non-contiguous grad, another ISA or thread count, a backend whose ``checked_rule_steps`` a
test replaced) steps the general way, which checks everything and raises what it must.

A group's structs are packed after the general way has stepped the same tensors on two steps
in a row, so a group whose set of grads changes every step (params without a grad on some
steps) pays for the signature only, never for a pack per step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.kernels import get_backend
from offload.kernels._rule_step import StepEntry

__all__ = ["PreparedGroups"]

_F32 = torch.float32
_T = torch.Tensor


class _Kept:
    """One group's kept batch, the signature it was packed for and the tensors it points at
    (their storages held, so that no other tensor can take their addresses: ``_signature``)."""

    __slots__ = ("sig", "batch", "tensors")

    def __init__(self, sig: list, batch: Any, tensors: list) -> None:
        self.sig, self.batch, self.tensors = sig, batch, tensors


class PreparedGroups:
    """Kept batches by slot (a group's index in the step's batches)."""

    def __init__(self) -> None:
        self._kept: Dict[int, _Kept] = {}
        self._seen: Dict[int, list] = {}  # slot -> the signature of its last general step

    def __getstate__(self) -> Dict[str, Any]:
        return {}  # (pointers into this process: pickles and copies start empty)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()

    def clear(self) -> None:
        self._kept.clear()
        self._seen.clear()

    def forget(self, slot: int) -> None:
        """Drop the slot's batch: its group steps nothing this step (no grads, or no params),
        and a kept batch holds its tensors' storages, which the user may have let go of."""
        self._kept.pop(slot, None)
        self._seen.pop(slot, None)

    def keep_slots(self, count: int) -> None:
        """Drop the batches of slots past ``count`` (groups removed from ``param_groups``):
        a kept batch holds its tensors' storages, and no step would reach it again."""
        for slot in [s for s in {*self._kept, *self._seen} if s >= count]:
            self.forget(slot)

    def step(self, slot: int, backend_name: Optional[str], num_threads: Optional[int], state: Dict,
             hyper: Any, items: Sequence[Tuple[torch.Tensor, torch.Tensor, int]]) -> bool:
        """Step ``items`` (a group's float32 part) through the slot's kept batch; False when
        it did not (nothing changed): the caller steps the general way, then ``remember``."""
        kept = self._kept.get(slot)
        if kept is None:
            return False
        backend = _native(backend_name)
        batch = kept.batch
        if backend is None or batch.rule is not hyper.rule or len(items) != batch.count:
            return False
        if _signature(state, hyper.rule.names, items) != kept.sig:
            del self._kept[slot]
            return False
        ptrs = _grad_pointers(items, batch.numels)
        if ptrs is None:
            return False
        return batch.run(ptrs, [s for _, _, s in items], hyper, backend._tail(num_threads))

    def remember(self, slot: int, backend_name: Optional[str], num_threads: Optional[int], state: Dict,
                 hyper: Any, items: Sequence[Tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """After a general step of ``items``: pack the slot's batch when the step before
        stepped the very same tensors."""
        backend = _native(backend_name)
        if backend is None or not items:
            return
        names = hyper.rule.names
        sig = _signature(state, names, items)
        if sig is None or self._seen.get(slot) != sig:
            self._seen[slot] = sig
            self._kept.pop(slot, None)
            return
        entries = _entries(state, names, items)
        batch = None if entries is None else backend.prepare_rule_steps(hyper.rule, entries, hyper, num_threads)
        if batch is not None:
            # their storages, not only the tensor objects: a later `p.data = ...` frees no address
            tensors = [t.detach() for e in entries for t in (e.param, *e.states)]
            self._kept[slot] = _Kept(sig, batch, tensors)


def _native(name: Optional[str]) -> Any:
    """The native backend, if it steps this call and its batch was not replaced (tests
    replace ``checked_rule_steps`` on the instance to inject failures)."""
    backend = get_backend(name)
    if getattr(backend, "prepare_rule_steps", None) is None:
        return None
    own = vars(backend)
    if "checked_rule_steps" in own or "run_structs" in own:
        return None
    return backend


def _signature(state: Dict, names: Tuple[str, ...], items: Sequence[Tuple[torch.Tensor, Any, int]]) -> Optional[list]:
    """Each param's and state's address and size, in order: all a kept struct holds of them.
    None if a param has no states yet, a state is not a tensor, or one of them is no longer
    contiguous. (A view of the same memory keeps the address and size: ``p.t_()`` of a
    square param, ``p.data = p.data.reshape(m, n).t()``, an ``expand()``ed param, a state
    viewed transposed: each was stepped as the old layout before this check. A state viewed
    as int32 (a param cannot be: torch refuses it) is stepped as the float32 memory it is, as
    before the view. A lazy negation, which only torch's private ``_neg_view`` puts on a
    param or state, is refused when the structs are packed and not looked for again: each of
    these columns costs ~0.3-0.5 ms per step over 6000 tensors. The kept batch holds the
    tensors it was packed for, so no other tensor can take one of their addresses while it is
    kept.)"""
    try:  # (column by column, with the methods mapped: a third cheaper than a loop per param)
        get = state.get
        entries = list(map(get, [p for p, _, _ in items]))
        tensors = [p for p, _, _ in items]
        for k in names:
            tensors += [st[k] for st in entries]
        n = len(tensors)
        if list(map(_T.is_contiguous, tensors)).count(True) != n:
            return None
        return list(map(_T.data_ptr, tensors)) + list(map(_T.numel, tensors))
    except (KeyError, AttributeError, TypeError, RuntimeError):  # no states yet, or not tensors
        return None


def _grad_pointers(items: Sequence[Tuple[torch.Tensor, Any, int]], numels: Sequence[int]) -> Optional[List[int]]:
    """Each grad's address, when every grad is a contiguous float32 CPU tensor of its param's
    size (column by column, as ``_signature``)."""
    try:
        grads = [g for _, g, _ in items]
        n = len(grads)
        if list(map(_T.numel, grads)) != numels or [g.dtype for g in grads].count(_F32) != n \
                or list(map(_T.is_contiguous, grads)).count(True) != n or [g.is_cpu for g in grads].count(True) != n:
            return None  # (a lazily negated grad was resolved by the step: RuleOptimizer._grads_with_params)
        return list(map(_T.data_ptr, grads))
    except (AttributeError, RuntimeError, TypeError):
        return None


def _entries(state: Dict, names: Tuple[str, ...], items) -> Optional[List[StepEntry]]:
    """The batch's entries over the very tensors (no contiguous copies), or None when one is
    not a float32, contiguous, non-empty CPU tensor of its param's size."""
    entries = []
    for p, g, s in items:
        states = tuple(state[p][k] for k in names)
        n = p.numel()
        for t in (p, g, *states):
            if not isinstance(t, torch.Tensor) or t.dtype is not _F32 or not t.is_contiguous() \
                    or not t.is_cpu or t.numel() != n or not n or t.is_neg():
                return None
        entries.append(StepEntry(p, g, states, None, s, None))
    return entries
