"""Grads leave a unit as soon as its backward is done: reduce-scattered into the shards.

[Note: reduce order] A unit's full grads (its views' ``.grad``, accumulated by autograd over
every use, tied params included) are reduce-scattered bucket by bucket (float32, summed,
then divided by the world: the average; [Note: one rank's grads] With one rank on the CPU the sum over ranks is the grads
themselves: each flat's view grads are copied (added, when accumulating) straight into the
shard grad, or into its swap file (grads on disk), with no float32 bucket: the same bits
(the bucketed path's bf16 -> float32 -> bf16 and its division by 1 are exact), a quarter of
the passes over the bytes.

[Note: reduce buckets]) into this rank's chunk,
added to ``shard.grad``, and freed. The reduce-scatters run on their own process group (``shard`` makes one), async, so
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

[Note: grads of a unit whose forward never ran] A parent that reads a unit's params itself
(``F.linear(x, self.lin.weight)``, never calling ``self.lin``) leaves grads in the unit's views
that no hook of the unit hands over. Several ranks reduce them in ``finish`` (with the rest).
One rank did not: they stayed in the views, the shard was never stepped, silently. Where the
views are the shard itself in RAM (one rank on the CPU, params not on NVMe) the parent read
the true values, so they are reduced as any unit's; elsewhere (params on NVMe, a device) the
unit was released, the parent read zeros, and the backward raises, naming the params.

[Note: reduce buckets] A flat's reduction is cut into buckets, so that its float32
temporary is never the whole padded flat. A reduce-scatter's input is ``world * k``
elements, rank r's part contiguous, so bucket b is the slice ``[b*k, (b+1)*k)`` of *every*
rank's chunk, laid out rank-major: built by copying those slices of the views' grads (zero
where a view has no grad, and over the padding), reduce-scattered into k float32 elements,
averaged into ``shard.grad[b*k:(b+1)*k]``. ``k = bucket_numel // world`` (the stage-2 path's
``FlatState.bucket_numel``: what the planner counts, plan/stage3.py). The values are those of
one whole-flat reduce-scatter, element for element. At most ``inflight`` buckets are in
flight; the next is built while the earlier ones reduce. A full window never *waits* during
the backward: the rest of the queue is issued later (at the next hook, or at the end of the
backward), in the same order. Waiting there could hang: a rank that left the gather plan
sits in a round (schedule.py) that the others join only at their backward's end, and a
rank blocked on a reduction that rank has not issued yet would never get there. The bucket
order (plan order, then by unit, flats and buckets in order) is the same on every rank;
only the time each is issued differs. The views' grads are taken (dropped from the views)
when the unit's reduction is queued and freed once its last bucket is built.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Set, Tuple

import torch

from offload.shard import device
from offload.zero import comm

__all__ = ["GradReducer", "DEFAULT_BUCKET_NUMEL", "DEFAULT_INFLIGHT"]

DEFAULT_BUCKET_NUMEL = 1 << 22  # offload/optim/flat/store.py FlatState.bucket_numel (16 MiB of float32)
DEFAULT_INFLIGHT = 2            # FlatState.inflight


def _completed(handle: Any) -> bool:
    done = getattr(handle, "is_completed", None)
    return True if done is None else bool(done())


def _take_grads(flat: Any) -> List[Tuple[torch.Tensor, int, int]]:
    """The views' grads as (flat grad, offset, numel), dropped from the views (and noted in
    ``flat.grads_taken``: [Note: a param without a grad])."""
    out = []
    for i, (leaf, (o, n)) in enumerate(zip(flat.leaves, flat.slots)):
        if leaf.grad is not None:
            out.append((leaf.grad.reshape(-1), o, n))
            leaf.grad = None
            flat.grads_taken[i] = True
    return out


class _FlatJob:
    """One flat's queued reduction: its taken grads, the next bucket's start."""

    def __init__(self, flat: Any, k: int) -> None:
        self.flat, self.lo, self.k = flat, 0, k
        self.fresh = flat.open_shard_grad(whole=k >= flat.chunk)
        self.grads = _take_grads(flat)

    def bucket(self) -> Tuple[torch.Tensor, int, int]:
        """The next bucket's reduce-scatter input (see the note) and its [lo, hi) in the chunk."""
        flat = self.flat
        lo, hi = self.lo, min(self.lo + self.k, flat.chunk)
        width = hi - lo
        buf = torch.zeros(flat.world * width, dtype=torch.float32, device=flat.full.device)
        on_device = flat.streams is not None
        for r in range(flat.world):
            a0, a1 = r * flat.chunk + lo, r * flat.chunk + hi
            for g, o, n in self.grads:
                s, e = max(o, a0), min(o + n, a1)
                if s < e:  # the device path: queued on the reduce stream (device.py)
                    buf[r * width + s - a0:r * width + e - a0].copy_(g[s - o:e - o], non_blocking=on_device)
        self.lo = hi
        if hi == flat.chunk:
            self.grads = []  # the last bucket built: the taken grads go
        return buf, lo, hi


class GradReducer:
    bucket_numel = DEFAULT_BUCKET_NUMEL
    """Elements of one reduce-scatter's input (all ranks' slices; see [Note: reduce buckets])."""
    inflight = DEFAULT_INFLIGHT
    """Buckets reducing at once (each a ``bucket_numel`` input and its output, float32)."""

    def __init__(self, units: List[Any], group: Any, world: int) -> None:
        self.units, self.group, self.world = units, group, world
        self.plan: Optional[List[int]] = None
        self.queue: Deque[_FlatJob] = deque()
        self.flying: Deque[Tuple[Any, Any, torch.Tensor, int, bool]] = deque()
        self.peak_inflight = 0  # the most buckets in flight at once (tests)
        self.begin()

    def begin(self) -> None:
        self.pos = 0
        self.on_plan = self.plan is not None and self.world > 1
        self.order: List[int] = []
        self.ready_set: Set[int] = set()
        self.done: Set[int] = set()

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
        """Per unit: 1 when this rank has grads for it (reduced already or waiting); then per
        param of every unit, in order: 1 when it had a grad since the last step."""
        units = [int(u.index in self.done or u.has_grads()) for u in self.units]
        leaves = [int(taken or leaf.grad is not None) for u in self.units for f in u.flats
                  for taken, leaf in zip(f.grads_taken, f.leaves)]
        return torch.tensor(units + leaves, dtype=torch.int64)

    def finish(self, anywhere: torch.Tensor, agreed: bool) -> None:
        """Reduce what is left (see the note), wait for every reduction, record the plan."""
        if self.world > 1:
            rest = self.plan[self.pos:] if self.plan is not None else []
            tail = [i for i in range(len(self.units)) if i not in set(rest) and i not in set(self.plan or ())]
            for i in rest + tail:
                if int(anywhere[i]) > 0 and i not in self.done:
                    self._reduce(self.units[i])
        else:
            self._reduce_unhooked()
        self.pump(block=True)
        self.plan = list(self.order) if agreed else None
        k = len(self.units)
        for u in self.units:  # [Note: a param without a grad]: the ranks' agreed flags
            for f in u.flats:
                f.grads_anywhere = [bool(int(x)) for x in anywhere[k:k + len(f.leaves)]]
                k += len(f.leaves)

    def _reduce_unhooked(self) -> None:
        """One rank: the units with grads that no hook handed over ([Note: grads of a unit
        whose forward never ran]): reduced where the parent read the true values, else an error."""
        for u in self.units:
            if u.index in self.done or not u.has_grads():
                continue
            if all(flat._alias and flat.tier is None for flat in u.flats):
                self._reduce(u)
                continue
            names = [n for f in u.flats for n, leaf in zip(f.names, f.leaves) if leaf.grad is not None]
            u.drop_grads()
            raise RuntimeError(f"offload.shard: {names} got grads though the forward of their unit {u.name!r} "
                               "never ran: a parent module reads them directly (as nn.MultiheadAttention reads "
                               "out_proj.weight), outside the unit's forward, where the unit is released and "
                               "reads zeros. Make the parent the unit (unit= its class), not this module")

    def _reduce(self, u: Any) -> None:
        self.done.add(u.index)
        flats = []
        for flat in u.flats:
            if flat.shard.requires_grad:
                flats.append(flat)
            else:  # frozen after shard() (``block.requires_grad_(False)``): no grad, as torch's frozen param
                flat.drop_grads()
        if self.world == 1 and all(flat.streams is None for flat in flats):
            for flat in flats:  # [Note: one rank's grads]
                flat.put_grads(_take_grads(flat))
            return
        k = max(1, self.bucket_numel // self.world)
        self.queue.extend(_FlatJob(flat, k) for flat in flats)
        self.pump()

    def pump(self, block: bool = False) -> None:
        """Retire the finished buckets, issue queued ones while fewer than ``inflight`` fly;
        ``block``: until the queue is empty and every bucket is retired (the end of a
        backward only: see the note)."""
        while True:
            while self.flying and _completed(self.flying[0][0]):
                self._retire()
            if self.queue and len(self.flying) < max(1, self.inflight):
                self._issue(self.queue[0])
                continue
            if not block or not self.flying:
                return
            self._retire()  # waits for the oldest

    def _issue(self, job: _FlatJob) -> None:
        if job.flat.streams is not None:  # on side streams: [Note: stage 3 on a device]
            self.flying.append(device.issue_bucket(job, self.group))
            if job.lo == job.flat.chunk:
                self.queue.popleft()
            self.peak_inflight = max(self.peak_inflight, len(self.flying))
            return
        buf, lo, hi = job.bucket()
        if job.lo == job.flat.chunk:
            self.queue.popleft()
        out = torch.empty(hi - lo, dtype=torch.float32, device=buf.device)
        # ``buf`` is kept by the handle's collective; dropping our reference frees it once done
        h = comm.reduce_scatter_async(out, buf, self.group)
        self.flying.append((h, job.flat, out, lo, job.fresh))
        self.peak_inflight = max(self.peak_inflight, len(self.flying))

    def _retire(self) -> None:
        if self.flying[0][1].streams is not None:
            device.retire_bucket(self.flying.popleft())
            return
        h, flat, out, lo, fresh = self.flying.popleft()
        h.wait()
        flat.add_shard_grad(out, lo, fresh)
