"""Where the flat store's grads come from (see [Note: what p.grad holds]).

[Note: what p.grad holds] ``p.grad`` keeps exactly torch's meaning: the local gradient,
accumulated by autograd over backward passes, cleared by ``zero_grad`` (either way). The
store never replaces or frees it; it *reads* it:

- CPU params, one rank: the kernel reads ``p.grad`` where it lies (it already is a host
  buffer in its own dtype; copying it first would only add a pass over memory).
- CUDA params, one rank: a post-accumulate-grad hook copies ``p.grad`` (own dtype, half the
  bytes of fp32 for fp16/bf16) into a pinned host flat buffer on a side stream as soon as
  autograd has accumulated it. The copy is tagged with (a weak reference to the grad, its
  version counter); at step time a tag that no longer matches ``p.grad`` (a later in-place
  change such as ``clip_grad_norm_`` or ``zero_()``, or a grad assigned by hand) is copied
  again, synchronously, so the step always sees what torch would. ``GradScaler.unscale_()``
  changes grads in place *without* bumping their version counters; ``begin_step`` sees
  that it ran (``found_inf`` set, ``grad_scale`` None in the step context) and drops every
  tag. ``copy_cpu_grads = True`` runs this path for CPU params too (the tests use it; there
  is no GPU in CI).
- Several ranks: at step time the grads are averaged across ranks, bucket by bucket
  (``FlatGroup.reduce_grads`` in ``offload/zero/flat_group.py``), or during backward with
  ``reduce_in_backward`` ([Note: reduce in backward] in offload/zero/backward_reduce.py).
  Each rank ends with the fp32 *sum* for its shard; the 1/N of the average is folded into
  the kernel's ``grad_scale`` (``GradSource.factor``).

[Note: releasing grads] ``release_grads=True`` (stages 0-2, offload "cpu"/"nvme"): ZeRO-Offload's
device footprint, the params only ([Note: release grads] in offload/plan/stage3.py). Each grad
leaves the device in backward and ``p.grad`` is then None:

- one rank: the hook copies the grad to the host buffer as above, then sets ``p.grad = None``
  (on CUDA the copy is queued on the grad stream and the grad's memory kept for it by
  ``record_stream``; the queued copies are waited for once they reach ``inflight`` buckets of
  ``bucket_numel`` elements, the planner's bound). The first backward of a step copies; the
  next ones *add* into the host copy in the param's dtype, as autograd's accumulation into
  ``p.grad`` would, so gradient accumulation gives the same bits.
- several ranks: the reduction in backward ([Note: reduce in backward], in contiguous buckets
  each summed into the rank that owns it) frees each grad once the last bucket holding part
  of it is sent; a later backward of the same step adds its sum
  into the fp32 grad shard (the sum of the micro-batches' sums: equal to the run without
  release_grads within rounding, not bit for bit, as it sums in another order; the grads of
  micro-batches inside ``opt.no_sync()`` stay on the device, accumulating, and go with the
  first backward after the block, which is bit for bit the same as without release_grads).
- the released grads belong to the step that reads them: ``opt.zero_grad()`` drops them, and
  so does every ``step()``, also a skipped one (as if ``zero_grad()`` ran after it; a loop
  that calls ``model.zero_grad()`` only is thus still right). ``zero_grad(set_to_none=False)``
  finds no grad to zero: a param without grad in the next step is then not stepped (without
  release_grads its zero grad would be, weight decay included). Inside ``opt.no_sync()`` grads
  stay where autograd puts them; one still on a param when ``step()`` begins is added in then.
  With a DDP-wrapped model (``grads_already_averaged``) nothing is released: DDP holds them.
- ``max_grad_norm`` clips from the host copies (the device's sum of squares of a grad copied
  once is kept, as above); ``opt.last_grad_norm`` is the norm. GradScaler cannot work with
  it: ``unscale_`` and its inf check read ``p.grad``, find none, and ``update()`` then fails
  on its "No inf checks were recorded": refused at the step with a clear error.

[Note: DDP] The optimizer averages grads itself; the model needs no DDP wrapper. If the
model *is* wrapped in DDP, its grads are already averaged: set
``opt.grads_already_averaged = True`` (the step context's flag, read at every step) and
the store only slices them, saving the second reduction. Averaging already-averaged grads
again would give the same values up to rounding, at the price of a redundant all-reduce.

[Note: a grad on some ranks only] torch skips a param without grad (no step, no weight
decay). Across ranks, a param counts as having a grad when any rank has one (missing grads
count as zeros in the average, as in DDP); ``grads(p)`` answers accordingly so that every
rank increments the same step counters. The answer comes from one small all-reduce per
step, made by ``agree()`` (the optimizer calls it before asking for grads; ``grads(p)``
itself is never a collective).

[Note: GradScaler across ranks] (offload/optim/scaler_sync.py): ``agree()`` also takes the
max over ranks of the ``found_inf`` GradScaler hands the step, so that all ranks skip a step
together and the shards stay consistent; the optimizer writes the agreed flag into the
scaler's own, so that every rank's ``update()`` changes its loss scale alike.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.kernels import get_backend
from offload.optim.context import StepContext
from offload.optim.scaler_sync import as_flag
from offload.zero import comm
from offload.zero.flat_group import FlatGroup

__all__ = ["GradSource", "flat_cpu"]


class GradSource:
    """The grads a step reads: p.grad, the hook's host copy, or this rank's reduced shard.

    ``groups``, ``where``, ``order`` and ``streams`` are the store's own containers (shared,
    not copied: a group added later is seen here); ``ctx`` is the optimizer's step context
    (no_sync, grads_already_averaged, max_grad_norm, grad_scale and found_inf)."""

    ELSEWHERE = torch.zeros(0)
    """Stands for a grad that exists on another rank only (this rank contributes zeros)."""
    RELEASED = torch.zeros(0)
    """Stands for a grad backward released to the host ([Note: releasing grads])."""

    def __init__(self, *, ctx: StepContext, groups: List[FlatGroup],
                 where: Dict[torch.Tensor, Tuple[FlatGroup, int]], order: List[torch.Tensor],
                 streams: Dict[torch.device, Tuple[Any, Any]], zero_stage: int, world: int, group: Any,
                 comm_dev: torch.device, backend: Optional[str], threads: Optional[int],
                 overlap: Callable[[], bool]) -> None:
        self._ctx = ctx
        self._groups, self._where, self._order, self._streams = groups, where, order, streams
        self.zero_stage, self.world, self.group, self._comm_dev = zero_stage, world, group, comm_dev
        self._backend, self._threads, self._overlap = backend, threads, overlap
        self.reducer = None  # a BackwardReducer when reducing during backward (set by the store)
        self.closed = False
        self._mask: Optional[Dict[torch.Tensor, bool]] = None
        self._reduced = False
        self.factor = 1.0
        """What the kernel's grad_scale is multiplied by: 1/N for a sum over N ranks."""
        self.release = False
        """[Note: releasing grads] (set by the store)."""
        self.release_bound = 0
        """Elements of grads whose copies may be queued at once (release: the planner's bound)."""
        self.held: Dict[torch.Tensor, Tuple[int, Any]] = {}
        """Released, one rank: param -> (backward passes in its host copy, device sum of squares or None)."""
        self._queued = 0
        self.grad_peak_numel = 0
        """Released: the most grad elements a hook saw alive on the device (its own, those queued)."""

    # ------------------------------------------------------------------ the grad hook
    def grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: copy the accumulated grad to the host buffer now."""
        g = p.grad
        if g is None or self.closed or self._ctx.no_sync or g.is_sparse:
            # inside opt.no_sync(): the grad stays on the device, accumulating; a sparse one is
            # the step's to densify or refuse ([Note: sparse grads] in offload/optim/sparse_grads.py)
            return
        if self.release:
            self._release(p, g)
            return
        fg, i = self._where[p]
        lo, hi = fg.layout.slot(i)
        fg.grad_tag[i] = (weakref.ref(g), g._version, self._copy(g, fg.host_grad[lo:hi]))

    def _copy(self, g: torch.Tensor, dst: torch.Tensor) -> Any:
        """dst <- g, on the grad stream where there is one; returns g's sum of squares taken on
        the device when clipping ([Note: device grad norm]), else None."""
        if self._overlap() and g.device in self._streams:
            grad_stream, _ = self._streams[g.device]
            grad_stream.wait_current()  # the grad was produced on the compute stream
            with grad_stream.context():
                dst.copy_(g.detach().reshape(-1), non_blocking=True)
            grad_stream.keep_alive(g)  # keep g's memory until the copy has read it
            self._queued += g.numel()
        else:
            dst.copy_(g.detach().reshape(-1))
        if g.device in self._streams and self._ctx.max_grad_norm is not None:
            # [Note: device grad norm] With clipping, the grad's sum of squares is taken here,
            # on the device (a reduction at its memory bandwidth, on the stream that made the
            # grad), so the step needs no pass of the host over the copied grads. It belongs
            # to this version of this grad: a later change (another micro-batch re-fires the
            # hook; an in-place op moves the version) falls back to the host's pass.
            return torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square()  # no fp32 overflow
        return None

    def _release(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """[Note: releasing grads], one rank: g into p's host copy (copied by the first backward
        of the step, added by the next ones), then p.grad = None."""
        fg, i = self._where[p]
        lo, hi = fg.layout.slot(i)
        dst = fg.host_grad[lo:hi]
        count, _ = self.held.get(p, (0, None))
        if self._queued and self._queued + g.numel() > self.release_bound:
            self.wait_copies()  # no more queued than the planner's bound ([Note: release grads])
        queued = self._queued
        if count == 0:
            sumsq = self._copy(g, dst)
        else:
            self.wait_copies()  # an earlier backward's copy lands in dst first
            dst.add_(g.detach().reshape(-1).to(dst.device))  # in p's dtype, as autograd adds
            sumsq = None  # the sum of squares of a sum is not that of its parts
        self.grad_peak_numel = max(self.grad_peak_numel, queued + g.numel())
        self.held[p] = (count + 1, sumsq)
        p.grad = None

    def drop_released(self) -> None:
        """The released grads are consumed (a step) or dropped (zero_grad)."""
        self.held = {}
        if self.reducer is not None:
            self.reducer.drop_released()

    @staticmethod
    def tag_current(tag: Any, g: torch.Tensor) -> bool:
        return tag is not None and tag[0]() is g and tag[1] == g._version

    def host_grad(self, fg: FlatGroup, i: int, g: torch.Tensor) -> torch.Tensor:
        """The host copy of p.grad (the hook's, or a fresh one when it is stale)."""
        lo, hi = fg.layout.slot(i)
        dst = fg.host_grad[lo:hi]
        if g is self.RELEASED:
            return dst
        if not self.tag_current(fg.grad_tag[i], g):
            dst.copy_(g.detach().reshape(-1))
            fg.grad_tag[i] = (weakref.ref(g), g._version, None)
        return dst

    def local(self, fg: FlatGroup, i: int, g: torch.Tensor) -> torch.Tensor:
        """One rank: param ``i``'s whole grad as a flat CPU tensor the kernel reads."""
        return self.host_grad(fg, i, g) if fg.host_grad is not None else flat_cpu(g)

    def piece(self, fg: FlatGroup, i: int, pc: Any, start: int, g: torch.Tensor) -> torch.Tensor:
        """The grad of piece ``pc`` of param ``i`` (``g``: what ``grads(p)`` gave), 1-D:
        this rank's reduced shard (several ranks), or the param's own grad (one rank)."""
        if self.world > 1:
            return fg.gshard[pc.lo - start:pc.hi - start]
        return self.local(fg, i, g)[pc.param_offset:pc.param_offset + pc.numel]

    def wait_copies(self) -> None:
        for grad_stream, _ in self._streams.values():
            grad_stream.synchronize()
        self._queued = 0

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """A new step (the context holds GradScaler's facts); make its skip decision global."""
        self._mask = None
        self._reduced = False
        found_inf = self._ctx.found_inf
        if self.release:
            self._begin_released_step(found_inf)
        if found_inf is not None and self._ctx.grad_scale is None:
            # GradScaler.unscale_() ran: it divides the grads in place with an op that does
            # not bump their version counters, so copies made before it look current.
            # Forget them all: grads are copied / reduced again at this step.
            for fg in self._groups:
                fg.grad_tag = [None] * len(fg.params)
            if self.reducer is not None:
                self.reducer.forget()
        # (Several ranks: found_inf is agreed by agree(), the step's first collective.)

    def _begin_released_step(self, found_inf: Any) -> None:
        """[Note: releasing grads]: refuse GradScaler before anything changes; one rank: a grad
        still on a param (left by opt.no_sync()) joins its host copy now."""
        if found_inf is not None or self._ctx.grad_scale is not None:
            raise RuntimeError(
                "release_grads=True cannot be used with torch.amp.GradScaler: backward frees p.grad once copied "
                "to the host, so GradScaler's unscale_ and inf check find no grads and its update() fails "
                "('No inf checks were recorded'); use bf16 autocast (no scaler needed) or release_grads=False")
        if self.world == 1:
            for p in self._order:
                if p.grad is not None and not p.grad.is_sparse and p in self._where and \
                        self._where[p][0].host_grad is not None:
                    self._release(p, p.grad)

    def agree(self, failed: bool = False, facts: Tuple[int, int] = (0, 0)) -> Optional[List[Tuple[int, int, int]]]:
        """Several ranks: one all-reduce settles which params have a grad on any rank this
        step ([Note: a grad on some ranks only]) and GradScaler's found_inf (a step skipped
        on every rank or on none, [Note: GradScaler across ranks]), and gives each rank's
        (failed, *facts) ([Note: a step the ranks agree to begin] in step_agreement.py). A
        collective: every rank calls it, once a step, before ``grads``; later calls in the
        same step do nothing (None)."""
        # (a failed rank takes the collective whatever its mask: one left from its last step
        # when it failed before this step's begin_step, closed or in the failed state)
        if self.world == 1 or (self._mask is not None and not failed):
            return None
        released = self.reducer.released if self.reducer is not None else ()
        n, found_inf = len(self._order), as_flag(self._ctx.found_inf)  # (the int 0 on a rank without grads)
        vec = torch.zeros(n + 1 + 3 * self.world, dtype=torch.int64)
        vec[:n] = torch.tensor([p.grad is not None or p in released for p in self._order], dtype=torch.int64)
        vec[n] = int(isinstance(found_inf, torch.Tensor) and bool(found_inf.detach().cpu().gt(0).any()))
        row = n + 1 + 3 * comm.world_and_rank(self.group)[1]
        vec[row:row + 3] = torch.tensor((int(failed),) + tuple(facts))
        vec = vec.to(self._comm_dev)
        comm.all_reduce(vec, self.group, op=torch.distributed.ReduceOp.MAX)  # (each rank wrote its own row)
        got = vec.tolist()
        self._mask = {p: bool(h) for p, h in zip(self._order, got[:n])}
        if isinstance(found_inf, torch.Tensor):
            self._ctx.found_inf = torch.full(found_inf.shape, float(got[n]), dtype=found_inf.dtype,
                                             device=found_inf.device)
        return [tuple(got[n + 1 + 3 * r: n + 4 + 3 * r]) for r in range(self.world)]  # type: ignore[misc]

    def grads(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        if self.world == 1:
            return self.RELEASED if p.grad is None and p in self.held else p.grad
        if self._mask is None:
            raise RuntimeError("the flat store's grads(p) needs agree_on_grads() first on several ranks: which "
                               "params have a grad is settled by a collective, once a step, on every rank")
        if p.grad is not None:
            return p.grad
        return self.ELSEWHERE if self._mask[p] else None

    def _reduce(self) -> None:
        """Average grads across ranks into each group's fp32 shard buffer (see the notes)."""
        if self._reduced:
            return
        self.agree()  # every rank agrees on which params have a grad this step
        only_slice = self._ctx.grads_already_averaged
        # The shard buffers hold the sum over ranks (folded into the kernel as 1/N) or,
        # after DDP, the average already.
        self.factor = 1.0 if only_slice else 1.0 / self.world
        if self.reducer is not None and not only_slice:
            self.reducer.finish()  # started during backward: [Note: reduce in backward]
        else:
            for fg in self._groups:
                fg.reduce_grads(self.group, self.zero_stage, only_slice)
        self._reduced = True

    def prepare(self) -> None:
        """Make this step's grads ready where the kernel reads them: the cross-rank
        reduction, or the pending host copies."""
        if self.world > 1:
            self._reduce()
        else:
            self.wait_copies()

    def global_sumsq(self, work) -> Tuple[float, bool]:
        """The grads' sum of squares over every rank (unscaled), and whether one is not finite."""
        kernel = get_backend(self._backend)
        if self.world > 1:
            self._reduce()
            acc = torch.zeros(2, dtype=torch.float64)
            for fg in self._groups:
                if fg.gshard.numel():
                    s, bad = kernel.grad_sumsq(fg.gshard, num_threads=self._threads)
                    acc[0] += s
                    acc[1] += float(bad)
            acc = acc.to(self._comm_dev)
            comm.all_reduce(acc, self.group)
            s, bad = acc.tolist()
            return s * self.factor * self.factor, bad > 0
        self.wait_copies()
        return self._local_sumsq(kernel, work)

    def _local_sumsq(self, kernel, work) -> Tuple[float, bool]:
        total, nonfinite = 0.0, False
        on_device: Dict[torch.device, List[torch.Tensor]] = {}
        for _, items in work:
            for p, g in items:
                fg, i = self._where[p]
                tag = fg.grad_tag[i] if fg.host_grad is not None else None
                if g is self.RELEASED:
                    tag = (None, 0, self.held[p][1])  # the device's sum of squares of one copy, or None
                if (g is self.RELEASED or self.tag_current(tag, g)) and tag[2] is not None:
                    on_device.setdefault(tag[2].device, []).append(tag[2])  # [Note: device grad norm]
                    continue
                src = self.local(fg, i, g)
                if src.numel():
                    s, bad = kernel.grad_sumsq(src, num_threads=self._threads)
                    total += s
                    nonfinite |= bad
        for parts in on_device.values():
            s = float(torch.stack(parts).double().sum())  # one synchronisation per device
            nonfinite |= not math.isfinite(s)
            total += s
        return total, nonfinite


def flat_cpu(g: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous CPU view (or copy) of a grad."""
    if g.device.type != "cpu":
        g = g.detach().to("cpu")
    return g.detach().reshape(-1) if g.is_contiguous() else g.detach().contiguous().view(-1)
