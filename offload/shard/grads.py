"""Grads leave a unit as soon as its backward is done: reduce-scattered into the shards.

[Note: reduce order] A unit's full grads (its views' ``.grad``, accumulated by autograd over
every use, tied params included) are flattened, reduce-scattered (float32, summed, then
divided by the world: the average) into this rank's chunk, added to ``shard.grad``, and
freed. The reduce-scatters run on their own process group (``shard`` makes one), async, so
that they never interleave with the all-gathers (schedule.py) in a rank-dependent way. On
that group every rank must issue the same reductions in the same order, so:

- the order of the units' ready events recorded in an earlier backward and agreed by every
  rank is the *plan*; a unit ready in plan order is reduced at once; one ready ahead of the
  plan waits for those before it; one not in the plan stops the eager reductions;
- at the end of the backward (after the schedule's final round, which sums every rank's
  "has grads" flags) each rank reduces, in plan order and then by unit index, every unit
  that has grads on some rank and that it has not reduced yet (with zeros where it has
  none). A unit with grads on no rank is not reduced: its shard keeps ``grad=None``, as a
  param outside the graph does in torch.
"""
from __future__ import annotations

from typing import Any, List, Optional, Set

import torch

from offload.zero import comm

__all__ = ["GradReducer"]


class GradReducer:
    def __init__(self, units: List[Any], group: Any, world: int) -> None:
        self.units, self.group, self.world = units, group, world
        self.plan: Optional[List[int]] = None
        self.begin()

    def begin(self) -> None:
        self.pos = 0
        self.on_plan = self.plan is not None and self.world > 1
        self.order: List[int] = []
        self.ready_set: Set[int] = set()
        self.done: Set[int] = set()
        self.pending: List[Any] = []

    def ready(self, u: Any) -> None:
        """``u``'s grads are complete on this rank."""
        if u.index in self.ready_set:
            return
        self.order.append(u.index)
        self.ready_set.add(u.index)
        if self.world == 1:
            self._reduce(u)
            return
        if not self.on_plan:
            return
        if u.index not in self.plan[self.pos:]:
            self.on_plan = False
            return
        while self.pos < len(self.plan) and self.plan[self.pos] in self.ready_set:
            self._reduce(self.units[self.plan[self.pos]])
            self.pos += 1

    def local_flags(self) -> torch.Tensor:
        """Per unit: 1 when this rank has grads for it (reduced already or waiting)."""
        return torch.tensor([int(u.index in self.done or u.has_grads()) for u in self.units], dtype=torch.int64)

    def finish(self, anywhere: torch.Tensor, agreed: bool) -> None:
        """Reduce what is left (see the note), wait for every reduction, record the plan."""
        if self.world > 1:
            rest = self.plan[self.pos:] if self.plan is not None else []
            tail = [i for i in range(len(self.units)) if i not in set(rest) and i not in set(self.plan or ())]
            for i in rest + tail:
                if int(anywhere[i]) > 0 and i not in self.done:
                    self._reduce(self.units[i])
        for h, flat, out in self.pending:
            h.wait()
            flat.add_shard_grad(out)
        self.pending = []
        self.plan = list(self.order) if agreed else None

    def _reduce(self, u: Any) -> None:
        self.done.add(u.index)
        for flat in u.flats:
            full = flat.take_grads()
            out = torch.empty(flat.chunk, dtype=torch.float32, device=full.device)
            # ``full`` is kept by the handle's collective; dropping our reference frees it
            # once the reduction is done.
            h = comm.reduce_scatter_async(out, full, self.group)
            self.pending.append((h, flat, out))
