"""When the units' all-gathers are issued: the same collectives, in the same order, on
every rank, whatever each rank's forward does.

[Note: gather schedule] A phase (a forward, or a backward) asks for units one at a time
(``acquire``). The gathers are collectives, so every rank must issue the same ones in the
same order, but ranks may differ in which units they run (a unit skipped on one rank, a
forward whose order changes). Two modes:

- *on the plan*: the order recorded in an earlier phase, agreed by every rank. Gathers are
  issued in plan order, ``prefetch`` ahead of the unit in use (async: gloo's worker thread
  runs them while this unit computes). A unit asked for further ahead in the plan issues
  the entries up to it (the skipped ones are gathered and kept until used or the phase
  ends). A unit not ahead in the plan (the order changed) finishes the plan first, every
  entry issued as the other ranks will, then goes to rounds.
- *rounds*: one small all-reduce says which unit each rank needs now (or that it is done
  with the phase); every rank gathers each unit some rank asked for (into a buffer thrown
  away when it did not ask). A rank done with its phase keeps taking part in rounds until
  every rank is done (the final round), so nothing waits for a collective no one issues.

The final round also carries each rank's hash of its order of first uses: when all agree,
that order is the next phase's plan; otherwise the next phase runs by rounds (and records
again). The first phase of each kind runs by rounds. The final round carries a per-unit
flag vector for the caller too (summed over ranks: which units have grads somewhere).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.zero import comm

__all__ = ["GatherSchedule", "order_hash"]


def order_hash(order: Sequence[int]) -> int:
    """A hash of a sequence of unit indices that is the same in every process."""
    h = len(order)
    for i in order:
        h = (h * 1000003 + i + 1) % (2 ** 61 - 1)
    return h


class GatherSchedule:
    def __init__(self, units: List[Any], group: Any, world: int, rank: int, prefetch: int = 1) -> None:
        self.units, self.group, self.world, self.rank = units, group, world, rank
        self.prefetch = prefetch
        self.plans: Dict[str, Optional[List[int]]] = {"fwd": None, "bwd": None}
        self.replans = 0  # how many times an agreed plan was dropped (an order change)
        self.rounds = 0
        self.peak_live = 0
        self.phase: Optional[str] = None
        self.last_order: Dict[str, List[int]] = {}  # each phase's order of first uses, for read hints

    # ------------------------------------------------------------------ a phase
    def begin(self, phase: str) -> None:
        self.phase = phase
        self.plan = self.plans[phase]
        self.issued = 0
        self.on_plan = self.plan is not None and self.world > 1
        self.seen: List[int] = []
        self.waiting: Dict[int, List[Tuple[Any, Any]]] = {}

    def acquire(self, u: Any) -> None:
        """``u``'s params gathered and live (no-op when live already)."""
        if u.live:
            return
        self.seen.append(u.index)
        if self.world == 1:
            for h, _ in u.gather(self.group):
                h.wait()
            u.live = True
            self._track()
            self._hint_reads(u.index)
            return
        if u.index not in self.waiting:
            if self.on_plan and u.index in self.plan[self.issued:]:
                stop = self.plan.index(u.index, self.issued)
                while self.issued <= stop:
                    self._issue_next()
            else:
                self._finish_plan()
                self._round(u.index, None)
        for h, _ in self.waiting.pop(u.index, []):
            h.wait()
        u.live = True  # after the gathers: a plan entry of a live unit gathers into scratch
        while self.on_plan and self.issued < len(self.plan) and len(self.waiting) < self.prefetch:
            self._issue_next()
        self._hint_reads(u.index)

    def _hint_reads(self, i: int) -> None:
        """Params on NVMe: start reading the shards of the ``prefetch`` units whose gathers
        come next in the last order of this phase (a rank-local hint, no collective), so the
        disk works while unit ``i`` computes (FlatParam.prefetch_shard)."""
        order = self.last_order.get(self.phase)
        if not order or i not in order:
            return
        at = order.index(i) + 1
        if self.on_plan:
            at = max(at, self.issued)
        for j in order[at:at + self.prefetch]:
            if not self.units[j].live:
                self.units[j].prefetch_shards()

    def release(self, u: Any) -> None:
        u.live = False
        if u.index not in self.waiting:  # a gather for a later use may be writing into it
            u.free()

    def end(self, flags: torch.Tensor, extra_hash: int = 0) -> Tuple[torch.Tensor, bool]:
        """Close the phase (rounds until every rank is done): the flags summed over ranks,
        and whether every rank gave the same ``extra_hash``."""
        self.last_order[self.phase] = list(self.seen)
        if self.world == 1:
            self.plans[self.phase] = None
            self._drop_waiting()
            return flags.clone(), True
        self._finish_plan()
        while True:
            v = self._round(None, flags, extra_hash)
            if int(v[0]) == self.world:
                break
        U, W = len(self.units), self.world
        mine = order_hash(self.seen)
        hashes = v[1 + U:1 + U + W]
        agreed = bool((hashes == mine).all())
        if self.plans[self.phase] is not None and (not agreed or self.plans[self.phase] != self.seen):
            self.replans += 1
        self.plans[self.phase] = list(self.seen) if agreed else None
        extra = v[1 + U + W:1 + U + 2 * W]
        self._drop_waiting()
        return v[1 + U + 2 * W:], bool((extra == extra_hash).all())

    # ------------------------------------------------------------------ the collectives
    def _issue_next(self) -> None:
        i = self.plan[self.issued]
        self.issued += 1
        u = self.units[i]
        if u.live:  # in use here: the same bytes, into a buffer thrown away
            for h, _ in u.gather(self.group, scratch=True):
                h.wait()
            return
        self.waiting.setdefault(i, []).extend(u.gather(self.group))
        self._track()

    def _finish_plan(self) -> None:
        while self.on_plan and self.issued < len(self.plan):
            self._issue_next()
        self.on_plan = False

    def _round(self, want: Optional[int], flags: Optional[torch.Tensor], extra_hash: int = 0) -> torch.Tensor:
        U, W = len(self.units), self.world
        v = torch.zeros(1 + U + 2 * W + U, dtype=torch.int64)
        if want is None:
            v[0] = 1
            v[1 + U + self.rank] = order_hash(self.seen)
            v[1 + U + W + self.rank] = extra_hash
            v[1 + U + 2 * W:] = flags
        else:
            v[1 + want] = 1
        dev = comm.comm_device(self.group)
        v = v.to(dev)
        comm.all_reduce(v, self.group)
        v = v.cpu()
        self.rounds += 1
        for i in torch.nonzero(v[1:1 + U]).flatten().tolist():
            mine = i == want
            handles = self.units[i].gather(self.group, scratch=not mine)
            if mine:
                self.waiting.setdefault(i, []).extend(handles)
                self._track()
            else:
                for h, _ in handles:
                    h.wait()
        return v

    def _drop_waiting(self) -> None:
        """Gathers issued but never used (a unit this rank skipped): wait, then free."""
        for i, handles in list(self.waiting.items()):
            for h, _ in handles:
                h.wait()
            if not self.units[i].live:
                self.units[i].free()
        self.waiting.clear()

    def _track(self) -> None:
        live = sum(u.live_bytes() for u in self.units)
        self.peak_live = max(self.peak_live, live)
