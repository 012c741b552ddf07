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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["StepContext", "StepCounts"]


class StepCounts:
    """The per-param step counts, kept in torch's place: ``state[p]["step"]`` (a float
    scalar tensor, as torch's Adam keeps it). ``state_of`` returns the optimizer's current
    ``state`` mapping (torch's load_state_dict replaces that dict, so it is looked up on
    each access, never cached)."""

    def __init__(self, state_of: Callable[[], Dict[torch.Tensor, Dict[str, Any]]]) -> None:
        self._state_of = state_of

    def get(self, p: torch.Tensor) -> int:
        """``p``'s step count; 0 before its first step."""
        step = self._state_of().get(p, {}).get("step")
        return 0 if step is None else int(step.item() if torch.is_tensor(step) else step)

    def has(self, p: torch.Tensor) -> bool:
        return "step" in self._state_of().get(p, {})

    def set(self, p: torch.Tensor, n: int) -> None:
        """Set ``p``'s count; ``n == 0`` removes it (a param that never stepped has no entry,
        as in torch)."""
        state = self._state_of()
        if n > 0:
            entry = state[p]  # torch's state is a defaultdict(dict)
            step = entry.get("step")
            if torch.is_tensor(step) and step.numel() == 1 and not step.requires_grad:
                step.fill_(float(n))  # in place: a tensor the user holds follows
            else:
                entry["step"] = torch.tensor(float(n), dtype=_get_scalar_dtype())
        elif p in state:  # do not create entries in the defaultdict
            state[p].pop("step", None)
            if not state[p]:
                del state[p]

    def advance(self, params: Iterable[torch.Tensor]) -> None:
        """One more step for each of ``params``."""
        for p in params:
            self.set(p, self.get(p) + 1)


@dataclass
class StepContext:
    """Flags and facts a store reads, in place of its optimizer's attributes."""

    steps: StepCounts
    """The step counts (the one place they live)."""
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
