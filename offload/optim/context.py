"""What a store may know of its optimizer: the step context, handed down instead of the optimizer.

A store never reads an attribute of its optimizer (``offload/optim/protocol.py``). What it
needs comes down in one object, owned by the optimizer and given to the store when it is
built:

- the training flags, which the user or the optimizer set at any time and the store reads
  when it acts (a grad hook during backward reads ``no_sync``; a step reads
  ``grads_already_averaged``; ``state_dict()`` reads ``state_dict_rank0_only``);
- this step's facts, set by the optimizer before it calls ``store.step`` (``grad_scale``
  and ``found_inf`` as GradScaler handed them over; ``max_grad_norm``);
- the step counts, through ``StepCounts``: they live in one place, torch's
  ``opt.state[p]["step"]`` (so ``state_dict()`` and user code see them as torch's), and
  a store reads or sets them only through it. Swap manifests and checkpoints persist them;
  they are not a second copy a store keeps.

``found_inf`` is written back by a store that agrees on it across ranks (every rank must
skip the same steps); the optimizer then hands the agreed flag to GradScaler.

Torch's own containers (``opt.state``, ``opt.param_groups``) are replaced by torch's
``load_state_dict``; ``TorchState`` holds the current ones, and the optimizer rebinds it
whenever torch replaces them (``RuleOptimizer.__setattr__`` / ``__setstate__``). Neither the
context nor a store holds a reference, strong or weak, to the optimizer: dropping the
optimizer frees its store at once, as before, and pickling the optimizer pickles these
plain containers with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["StepContext", "StepCounts", "TorchState"]

OPT_META = "optimizer"
"""The key of a swap commit's metadata that holds ``StepContext.commit_meta``."""


class TorchState:
    """The optimizer's torch containers as they are now: ``state`` (per-param dicts, where
    the step counts and the host store's moments live) and ``param_groups``. Calling it
    returns ``state`` (so it serves as ``StepCounts``'s ``state_of``)."""

    def __init__(self, state: Optional[Dict[torch.Tensor, Dict[str, Any]]] = None,
                 param_groups: Optional[List[Dict[str, Any]]] = None) -> None:
        self.state = {} if state is None else state
        self.param_groups = [] if param_groups is None else param_groups

    def __call__(self) -> Dict[torch.Tensor, Dict[str, Any]]:
        return self.state

    def params(self) -> List[torch.Tensor]:
        """Every param, in param_groups order."""
        return [p for g in self.param_groups for p in g["params"]]


class StepCounts:
    """The per-param step counts, kept in torch's place: ``state[p]["step"]`` (a float
    scalar tensor, as torch's Adam keeps it). ``state_of`` returns the optimizer's current
    ``state`` mapping (torch's load_state_dict replaces that dict, so it is looked up on
    each access, never cached)."""

    def __init__(self, state_of: Callable[[], Dict[torch.Tensor, Dict[str, Any]]]) -> None:
        self._state_of = state_of
        # ids of the params given a count here: cleared() finds those whose count went since
        # (a stale id after unpickling only costs a restart of a param that holds fill values)
        self._counted: Set[int] = set()

    def get(self, p: torch.Tensor) -> int:
        """``p``'s step count; 0 before its first step."""
        step = self._state_of().get(p, {}).get("step")
        return 0 if step is None else int(step.item() if torch.is_tensor(step) else step)

    def has(self, p: torch.Tensor) -> bool:
        return "step" in self._state_of().get(p, {})

    def set(self, p: torch.Tensor, n: int) -> None:
        """Set ``p``'s count; ``n == 0`` removes it (a param that never stepped has no entry,
        as in torch). Always a new tensor, never an in-place change: torch's load_state_dict
        shares the step tensors with the dict it loaded, and changing them in place would
        couple two optimizers loaded from one dict."""
        state = self._state_of()
        if n > 0:
            self._counted.add(id(p))
            entry = state.setdefault(p, {})
            entry["step"] = _step_tensor(n, entry.get("step"), _get_scalar_dtype())
            return
        self._counted.discard(id(p))
        if p in state:  # do not create entries in the defaultdict
            state[p].pop("step", None)
            if not state[p]:
                del state[p]

    def settle(self, pairs: Iterable[Tuple[torch.Tensor, int]]) -> None:
        """``set(p, n)`` for each pair whose count is not ``n`` already: after a swapped
        store's step, whose optimizer advanced the counts before it (``advance``), only a
        store's own counts change (re-making 2000 equal step tensors cost 10 ms a step)."""
        state = self._state_of()
        for p, n in pairs:
            step = state.get(p, {}).get("step")
            if step is None or n < 1 or (step.item() if torch.is_tensor(step) else step) != n:
                self.set(p, n)
            else:
                self._counted.add(id(p))

    def cleared(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """Those of ``params`` given a count here that have none now: their state was cleared
        (``del opt.state[p]``, ``opt.state[p].clear()``, a new ``opt.state``)."""
        state = self._state_of()
        return [p for p in params if id(p) in self._counted and "step" not in state.get(p, {})]

    def restarted(self, params: Iterable[torch.Tensor]) -> None:
        """``params`` (cleared) were started afresh: ``cleared()`` no longer lists them."""
        self._counted.difference_update(id(p) for p in params)

    def recount(self, params: Iterable[torch.Tensor]) -> None:
        """torch's load replaced the counts: those of ``params`` that have one now are counted."""
        state = self._state_of()
        self._counted = {id(p) for p in params if "step" in state.get(p, {})}

    def all(self, params: Sequence[torch.Tensor]) -> List[int]:
        """The counts of ``params``, in order (0 for one that never stepped)."""
        return [self.get(p) for p in params]

    def set_all(self, params: Sequence[torch.Tensor], counts: Sequence[int]) -> None:
        """Set the counts of ``params`` (``counts`` in the same order; a length mismatch is a ValueError)."""
        if len(counts) != len(params):
            raise ValueError(f"{len(counts)} step counts for {len(params)} params")
        for p, n in zip(params, counts):
            self.set(p, int(n))

    def advance(self, params: Iterable[torch.Tensor]) -> Tuple[List[Tuple[torch.Tensor, Any]], List[int]]:
        """One more step for each of ``params``; returns what ``restore`` needs to undo it
        (the step tensors as they were, the very objects) and the new counts, in order."""
        params = list(params)
        if len(set(map(id, params))) != len(params):  # a param listed twice counts twice
            return self._advance_one_by_one(params)
        state = self._state_of()
        counts: List[int] = []
        entries: List[Dict[str, Any]] = []
        olds: List[Any] = []
        loaded: List[int] = []  # positions whose old step is a tensor of another dtype or device
        dtype, tensor = _get_scalar_dtype(), torch.Tensor
        for p in params:  # (set()'s work inlined: this runs per param per step)
            entry = state.get(p)
            if entry is None:
                entry = state[p] = {}
            step = entry.get("step")
            entries.append(entry)
            olds.append(step)
            if step is None:
                counts.append(1)
            elif isinstance(step, tensor):
                counts.append(1 + int(step.item()))
                if step.dtype is not dtype or not step.is_cpu:
                    loaded.append(len(counts) - 1)
            else:
                counts.append(1 + int(step))
        self._counted.update(map(id, params))
        for entry, t in zip(entries, _step_tensors(counts, dtype)):  # new tensors: see set()
            entry["step"] = t
        for i in loaded:
            entries[i]["step"] = _step_tensor(counts[i], olds[i], dtype)
        return list(zip(params, olds)), counts

    def _advance_one_by_one(self, params: List[torch.Tensor]) -> Tuple[List[Tuple[torch.Tensor, Any]], List[int]]:
        """``advance`` of a list with a param more than once (torch warns, and steps it as
        often as listed): each count made from the one before it."""
        state, dtype = self._state_of(), _get_scalar_dtype()
        before: List[Tuple[torch.Tensor, Any]] = []
        counts: List[int] = []
        for p in params:
            entry = state.get(p)
            if entry is None:
                entry = state[p] = {}
            step = entry.get("step")
            before.append((p, step))
            n = 1 + (0 if step is None else int(step.item() if torch.is_tensor(step) else step))
            entry["step"] = _step_tensor(n, step, dtype)
            self._counted.add(id(p))
            counts.append(n)
        return before, counts

    def restore(self, before: List[Tuple[torch.Tensor, Any]]) -> None:
        """Undo ``advance``: each param's step entry as it was."""
        state = self._state_of()
        for p, step in reversed(before):
            if step is not None:
                state.setdefault(p, {})["step"] = step
            elif p in state:
                state[p].pop("step", None)


def _step_tensors(counts: List[int], dtype: torch.dtype) -> Sequence[torch.Tensor]:
    """New scalar step tensors holding ``counts``, made at once: views of one new tensor
    (``unbind``: 0.4 us per count against 1 us for each its own ``torch.scalar_tensor``)."""
    if not counts:
        return ()
    first = counts[0]
    if counts.count(first) == len(counts):
        return torch.full((len(counts),), float(first), dtype=dtype).unbind(0)
    return torch.tensor(counts, dtype=dtype).unbind(0)


def _step_tensor(n: int, old: Any, dtype: torch.dtype) -> torch.Tensor:
    """A new step tensor holding ``n``: of a loaded floating step's dtype and device, else
    torch's scalar dtype on the CPU, as torch's Adam makes it. (``torch.scalar_tensor``:
    the same tensor as ``torch.tensor(float(n), dtype=...)`` in a third of the time.)"""
    if torch.is_tensor(old) and old.is_floating_point():
        return torch.scalar_tensor(float(n), dtype=old.dtype, device=old.device)
    return torch.scalar_tensor(float(n), dtype=dtype)


@dataclass
class StepContext:
    """Flags and facts a store reads, in place of its optimizer's attributes."""

    steps: StepCounts
    """The step counts (the one place they live)."""
    torch_state: Optional[TorchState] = None
    """torch's ``state`` and ``param_groups`` as they are now (the host store's moments live
    in ``state``, as torch's; the flat store drops the fp16/bf16 cast of ``master`` from it
    after a load)."""
    no_sync: bool = False
    """Inside ``opt.no_sync()``: backward leaves grads where autograd accumulates them."""
    grads_already_averaged: bool = False
    """The grads arrive already averaged across ranks (DDP): slice them, do not reduce."""
    state_dict_rank0_only: bool = False
    """``state_dict()`` keeps the gathered full states on rank 0 only."""
    max_grad_norm: Optional[float] = None
    """Global-norm clipping inside the step (None: off)."""
    grad_scale: Optional[torch.Tensor] = None
    """GradScaler's scale for this step (None when the grads are unscaled)."""
    found_inf: Optional[torch.Tensor] = None
    """GradScaler's found-inf flag for this step; a store may replace it by the ranks' agreed one."""
    commit_meta: Dict[str, Any] = field(default_factory=dict)
    """What the optimizer says of its states beyond the store's fields, JSON (Adam: which
    params hold a max_exp_avg_sq, ckpt_holding's ``holding``): a swapped store records it
    with each commit (``commit_extra``) and gives it back on resume (``resumed_from``), as
    it does the step counts. Replaced (never changed in place) when it changes."""

    @classmethod
    def fresh(cls, **flags: Any) -> "StepContext":
        """A context over empty torch containers (the optimizer rebinds them as torch sets
        them; a store built outside an optimizer, in a test or a bench, keeps its own)."""
        held = TorchState()
        return cls(steps=StepCounts(held), torch_state=held, **flags)

    def rebind(self, *, state: Any = None, param_groups: Any = None) -> None:
        """torch replaced its ``state`` or ``param_groups`` (load_state_dict, unpickling)."""
        if self.torch_state is None:
            return
        if state is not None:
            self.torch_state.state = state
        if param_groups is not None:
            self.torch_state.param_groups = param_groups

    def commit_extra(self) -> Dict[str, Any]:
        """What a swap commit records of ``commit_meta`` (nothing while it is empty: the
        manifests of optimizers that say nothing stay as they were)."""
        return {OPT_META: self.commit_meta} if self.commit_meta else {}

    def resumed_from(self, extra: Dict[str, Any]) -> None:
        """A swapped store resumed a commit whose metadata is ``extra``: its ``commit_meta``
        (none in a manifest written before it was recorded)."""
        meta = extra.get(OPT_META)
        self.commit_meta = dict(meta) if isinstance(meta, dict) else {}

    def begin_step(self, grad_scale: Any, found_inf: Any) -> None:
        """This step's facts as GradScaler handed them over (None when it did not)."""
        self.grad_scale, self.found_inf = grad_scale, found_inf
