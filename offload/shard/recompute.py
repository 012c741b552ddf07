"""Activation checkpointing of a sharded model: the units whose forward runs again during the
backward (``torch.utils.checkpoint``, a Hugging Face model's activation checkpointing).

[Note: activation checkpointing] A checkpointed region keeps no activations in the forward
and runs its forward again in the backward (the *recompute*), when autograd first needs one
of them. A unit's forward hooks (hooks.py) then run inside the autograd engine
(``in_autograd_backward``), with the runtime in its backward phase, and:

- the unit is acquired through the gather schedule (schedule.py), as every use is, so the
  recompute's gathers take their place in the backward's recorded order: each rank runs the
  same recompute at the same point (it is deterministic), so the ranks issue the same
  collectives in the same order, and the next backward prefetches them by plan;
- a unit the recompute gathered (it was not live) is *held* once its recomputed forward is
  over: the backward of that same unit often comes next, and its pre-backward claims it
  (no second gather). Held units are released before the recompute gathers another unit,
  before another unit's backward starts, and at the end of the backward: holding never adds
  a unit to what is gathered at once (the live window's budget, ``max_live_bytes``, counts
  it as gathered). So the units in use, the ones a recompute is inside of and what prefetch
  gathers ahead are live, not the whole region. A unit gathered before the recompute (its
  pre-backward did) is left to its backward: during the recompute of a region of several
  units two are gathered (the one recomputed, and the one whose backward waits for it),
  even under a budget of one;
- whether the recomputed graph is the one the grads flow through decides the rest.
  Non-reentrant (``use_reentrant=False``, torch's advice and Hugging Face's default): the
  original forward's graph is backwarded, with the recomputed tensors put in for the saved
  ones. Its hooks (``_PostBackward``, the pre-backward hook on the outputs) and its counted
  use are the ones that fire, so the recompute registers nothing: hooks on the recomputed
  graph would never fire and a use counted for it would keep the unit's grads from being
  reduced until the end. Reentrant (``use_reentrant=True``): the original forward ran under
  ``no_grad`` (no hooks, no use counted), and the checkpoint's backward runs a nested
  backward through the recomputed graph, so the recompute is a forward use like any other
  (inputs routed, outputs hooked, a use counted). Told apart by the autograd node whose
  backward is running (``reentrant_recompute``): a reentrant checkpoint recomputes in the
  backward of its ``CheckpointFunction`` (torch's, DeepSpeed's and Megatron's have that
  name), a non-reentrant one while unpacking a saved tensor of any other node. A unit with
  no forward use pending (``uses == 0``) is counted as well, so that another reentrant
  scheme's nested backward is still seen; on a graph nobody backwards that use is only
  closed by the final callback.
- a non-reentrant recompute stops as soon as it has recomputed the last saved tensor
  (``_StopRecomputationError``, raised through the modules' forwards): the exit is an
  ``always_call`` forward hook (``Recomputes.exit``), which sees that too.

A unit's grads are reduced once per backward, when its last counted use is done. A reentrant
recompute of a unit whose grads were already reduced in this backward (a unit called twice,
each inside a reentrant checkpoint, or also outside one) would bring grads after that: it is
refused by name (``use_reentrant=False`` counts every use in the forward), and the end of the
backward checks that no reduced unit got grads after its reduction (hooks.py ``final``).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

__all__ = ["Recomputes", "in_autograd_backward", "reentrant_recompute"]

_REENTRANT = "CheckpointFunctionBackward"  # the node of torch's (and DeepSpeed's, Megatron's) CheckpointFunction


def in_autograd_backward() -> bool:
    """Whether autograd's engine runs a backward on this thread (a recompute runs there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def reentrant_recompute() -> bool:
    """Whether the node whose backward runs now is a reentrant checkpoint's (see the note)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    node = current() if current is not None else None
    return node is not None and type(node).__name__ == _REENTRANT


class Recomputes:
    """The recomputed forwards in progress and the units held after them (see the note)."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        self.frames: List[Tuple[Any, bool, bool]] = []  # (unit, gathered by the recompute, counted as a use)
        self.held: List[Any] = []

    def reset(self) -> None:
        self.frames, self.held = [], []

    def enter(self, u: Any, track: bool) -> None:
        """``u``'s recomputed forward starts: gathered (and what was held released first)."""
        mine = not u.live or u in self.held  # gathered by a recompute: held again at its exit
        if u in self.held:
            self.held.remove(u)
        if not u.live:
            self.drop()
        self.schedule.acquire(u)
        self.frames.append((u, mine and not u.is_root, track))  # the root is live until the backward ends

    def current(self, u: Any) -> bool:
        """Whether the innermost recomputed forward is ``u``'s."""
        return bool(self.frames) and self.frames[-1][0] is u

    def exit(self, u: Any) -> Optional[bool]:
        """``u``'s recomputed forward is over (returned or raised): whether it counts as a use,
        None when it was no recompute."""
        if not self.current(u):
            return None
        _, mine, track = self.frames.pop()
        if mine:
            self.held.append(u)
        return track

    def drop(self, claim: Any = None) -> None:
        """Release the held units but ``claim`` (its backward starts: it keeps its gather)."""
        held, self.held = self.held, []
        for v in held:
            if v is not claim and v.live:
                self.schedule.release(v)
