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

[Note: live window budget] ``max_live_params`` / ``max_live_bytes`` (``shard``) cap what
prefetch may hold: when plan entry p is in use, gathers run ahead through entry
``horizon[p]``, the last q (at most ``prefetch`` past p) such that the root and the
distinct units of entries p..q fit in the budget (``horizons``). The unit in use is
gathered whatever its size (with one warning when it and the root alone are over), so the
peak is at most max(budget, the root and the largest unit). The horizon is a function of
the agreed plan and the units' sizes only, never of what this rank holds now: so every
rank issues the same gathers at the same plan positions. The budget can only delay an
issue, never reorder or drop one (the order stays the plan's, the rest is issued at the
unit's acquire or when the plan is finished), so a rank never waits on a gather another
rank withholds for reasons of its own: were it measured from the rank's live bytes, a
rank holding more (a unit it skipped, kept until the phase ends) would prefetch less and
the others would wait on it at every unit, and the ranks' windows would no longer be the
one the planner counts. What a rank *keeps* of a gather it must issue but does not need
yet (entries skipped on the way to a later one, the rest of the plan when it leaves the
plan) is its own business, the collective being the same: kept while its live bytes stay
within the budget, else gathered into a buffer dropped at once; and a unit needed now that
would pass the budget first drops the units gathered ahead (the rank leaving the plan it
prefetched by). A unit so dropped, if used later, is gathered again by rounds. So the peak holds on every rank, beyond one such transient
buffer, waited at once and not counted.

[Note: one rank's plan] One rank has nothing to agree on. On the CPU its full buffer is its
shard (flat_unit.py): there is nothing to gather, and a unit is acquired when asked for. On
a device (``FlatParam.streams``) a gather is a real copy (a host shard's to the device):
asked for only when needed, it makes the compute stream wait for it, unit after unit, and
the copies never overlap compute (bench/shard_gpu.py measured 1.00x on an H200: 0.4 of 87 ms
with kernels and copies at once). So one rank on a device keeps its own plan: the last
phase's order of first uses, prefetched as above, ``prefetch`` units ahead within the
budget. A unit asked for further ahead in the plan skips the entries before it (gathering
and keeping them, as ranks must, would hold units no one asked for: a whole model, when an
order changed near its start); a unit not ahead in the plan leaves it (nothing more is
issued ahead; the gathers issued and never used are dropped when the phase ends); and the
next phase plans by this one's order.

The final round also carries each rank's hash of its order of first uses: when all agree,
that order is the next phase's plan; otherwise the next phase runs by rounds (and records
again). The first phase of each kind runs by rounds. The final round carries a per-unit
flag vector for the caller too (summed over ranks: which units have grads somewhere).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.zero import comm

__all__ = ["GatherSchedule", "order_hash", "horizons"]


def order_hash(order: Sequence[int]) -> int:
    """A hash of a sequence of unit indices that is the same in every process."""
    h = len(order)
    for i in order:
        h = (h * 1000003 + i + 1) % (2 ** 61 - 1)
    return h


def horizons(plan: Sequence[int], cost: Sequence[int], root: int, budget: Optional[int], prefetch: int) -> List[int]:
    """Per plan entry p, the last entry prefetch may issue while p is in use (see [Note:
    live window budget]): at most ``prefetch`` past p, the root's ``cost`` and those of the
    distinct units of entries p..q within ``budget`` (None: no budget); at least p."""
    out = []
    for p, first in enumerate(plan):
        held = {first, root}
        total = cost[root] + (cost[first] if first != root else 0)
        q = p
        while q + 1 < len(plan) and q + 1 - p <= prefetch:
            nxt = plan[q + 1]
            add = 0 if nxt in held else cost[nxt]
            if budget is not None and total + add > budget:
                break
            total += add
            held.add(nxt)
            q += 1
        out.append(q)
    return out


def unit_cost(u: Any, in_bytes: bool) -> int:
    """A unit's gathered size: bytes, or params (its flats' padded elements)."""
    return sum(f.nbytes if in_bytes else f.padded for f in u.flats)


class GatherSchedule:
    def __init__(self, units: List[Any], group: Any, world: int, rank: int, prefetch: int = 1,
                 budget: Optional[int] = None, in_bytes: bool = True) -> None:
        self.units, self.group, self.world, self.rank = units, group, world, rank
        self.prefetch = prefetch
        self.budget, self.in_bytes = budget, in_bytes  # the live window's cap, in bytes or params
        self.cost = [unit_cost(u, in_bytes) for u in units]
        # the final round's flags: one per unit, then one per param of every unit (grads.py)
        self.nflags = len(units) + sum(len(f.leaves) for u in units for f in u.flats)
        self._horizons: Dict[Tuple[int, ...], List[int]] = {}
        self.warned = False
        self.peak_live_params = 0
        self.plans: Dict[str, Optional[List[int]]] = {"fwd": None, "bwd": None}
        self.replans = 0  # how many times an agreed plan was dropped (an order change)
        self.rounds = 0
        self.peak_live = 0
        self.phase: Optional[str] = None
        self.last_order: Dict[str, List[int]] = {}  # each phase's order of first uses, for read hints
        # [Note: one rank's plan]: one rank whose gathers are copies to a device plans alone
        self.plans_alone = world == 1 and any(f.streams is not None for u in units for f in u.flats)

    # ------------------------------------------------------------------ a phase
    def begin(self, phase: str) -> None:
        self.phase = phase
        self.plan = self.plans[phase]
        self.issued = 0
        self.on_plan = self.plan is not None and (self.world > 1 or self.plans_alone)
        self.seen: List[int] = []
        self.waiting: Dict[int, List[Tuple[Any, Any]]] = {}
        self.cursor = -1  # the plan entry in use (the last one acquired)
        self.horizon: List[int] = []
        if self.on_plan:
            key = tuple(self.plan)
            if key not in self._horizons:
                self._horizons[key] = horizons(self.plan, self.cost, 0, self.budget, self.prefetch)
            self.horizon = self._horizons[key]

    def acquire(self, u: Any) -> None:
        """``u``'s params gathered and live (no-op when live already)."""
        if u.live:
            return
        self.seen.append(u.index)
        self._check_budget(u)
        if self.world == 1 and self.on_plan and u.index not in self.waiting and u.index not in self.plan[self.issued:]:
            self.on_plan = False  # one rank off its plan: no one to agree with, nothing issued ahead
        if self.world == 1 and not self.on_plan:
            # the next units' reads go before this one's wait: the disk never idles between
            # two reads (the pages they fill are held during this unit's compute anyway)
            self._hint_reads(u.index)
            for h, _ in u.gather(self.group):
                h.wait()
            u.live = True
            self._track()
            return
        if u.index not in self.waiting:
            if self.on_plan and u.index in self.plan[self.issued:]:
                stop = self.plan.index(u.index, self.issued)
                room = 0 if u.live_bytes() else self.cost[u.index]  # kept for u, needed at the end
                if self.world == 1:
                    self.issued = stop  # one rank gathers no entry skipped: no one else issues it
                while self.issued <= stop:
                    self._issue_next(needed=self.issued == stop, reserve=room)
            else:
                self._finish_plan()
                self._round(u.index, None)
        if self.on_plan and u.index in self.plan[self.cursor + 1:self.issued]:
            self.cursor = self.plan.index(u.index, self.cursor + 1, self.issued)
        for h, _ in self.waiting.pop(u.index, []):
            h.wait()
        u.live = True  # after the gathers: a plan entry of a live unit gathers into scratch
        while (self.on_plan and self.issued < len(self.plan) and len(self.waiting) < self.prefetch
               and self.issued <= self.horizon[max(self.cursor, 0)]):
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
            plan = list(self.seen) if self.plans_alone else None
            if self.plans[self.phase] is not None and self.plans[self.phase] != plan:
                self.replans += 1
            self.plans[self.phase] = plan
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
    def _fits(self, u: Any, reserve: int) -> bool:
        """Whether keeping ``u``'s gather leaves the gathered buffers, and ``reserve`` more,
        within the budget."""
        if self.budget is None or any(f.allocated() for f in u.flats):
            return True
        live = sum(unit_cost(v, self.in_bytes) for v in self.units if any(f.allocated() for f in v.flats))
        return live + self.cost[u.index] + reserve <= self.budget

    def _evict(self, u: Any) -> None:
        """Make room for ``u``, needed now: drop units gathered ahead (latest first) while
        ``u`` would pass the budget. Their collectives are done; if used later, they are
        gathered again by rounds (a rank's own choice: see the note)."""
        for i in reversed(list(self.waiting)):
            if self._fits(u, 0):
                return
            if i == u.index or self.units[i].live:
                continue
            for h, _ in self.waiting.pop(i):
                h.wait()
            self.units[i].free()

    def _issue_next(self, needed: bool = False, reserve: int = 0) -> None:
        i = self.plan[self.issued]
        self.issued += 1
        u = self.units[i]
        if needed:
            self._evict(u)
        if u.live or not (needed or self._fits(u, reserve)):  # the same bytes, into a buffer thrown away
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
        v = torch.zeros(1 + U + 2 * W + self.nflags, dtype=torch.int64)
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
            if mine:
                self._evict(self.units[i])
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

    def _check_budget(self, u: Any) -> None:
        need = self.cost[0] + (self.cost[u.index] if u.index else 0)
        if self.budget is None or need <= self.budget or self.warned:
            return
        self.warned = True
        what = "max_live_bytes" if self.in_bytes else "max_live_params"
        warnings.warn(f"offload.shard: unit {u.name or '<root>'!r} and the root unit need {need:,} "
                      f"{'bytes' if self.in_bytes else 'params'} gathered, over {what}={self.budget:,}; "
                      "the unit in use is gathered anyway (no prefetch while it is): raise the budget "
                      "or cut the unit smaller (unit=) to stay within it", stacklevel=3)

    def _track(self) -> None:
        live = sum(u.live_bytes() for u in self.units)
        self.peak_live = max(self.peak_live, live)
        params = sum(f.padded for u in self.units for f in u.flats if f.allocated())
        self.peak_live_params = max(self.peak_live_params, params)
