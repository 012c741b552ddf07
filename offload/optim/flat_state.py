"""Flat fp32 states on the host for device or fp16/bf16 params, optionally partitioned (ZeRO 1/2).

This is the store behind ``offload.Adam``/``AdamW`` whenever params are not fp32 CPU tensors
updated in place (see [Note: store interface] in ``host_state.py``): fp16/bf16 params on the
CPU, params on CUDA, and any params partitioned at stage 1 or 2.

Params are grouped by (device, dtype) into *flat groups* (see [Note: flat layout] in
``offload/zero/partition.py``). For each, this rank keeps its shard of a flat fp32 master,
``exp_avg`` and ``exp_avg_sq`` in host buffers from the memory layer (with CUDA, only the
buffers DMA touches are pinned; with ``offload="nvme"`` master and moments go to swap files,
see [Note: nvme]). One step
runs the fused kernel per (param ∩ shard) piece (cut into sub-groups for CUDA params or when
``sub_group_size`` is given); the kernel upcasts the grad and writes the fp16/bf16 copy of
the updated master in the same pass.

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
  changes grads in place *without* bumping their version counters; the step pre-hook sees
  that it ran (``found_inf`` set, ``grad_scale`` None) and drops every tag. ``copy_cpu_grads = True``
  runs this path for CPU params too (the tests use it; there is no GPU in CI).
- Several ranks: at step time the grads are averaged across ranks, bucket by bucket
  (``FlatGroup.reduce_grads`` in ``offload/zero/flat_group.py``; not yet overlapped with the
  backward pass). Each rank ends with the fp32 *sum* for its shard; the 1/N of the average
  is folded into the kernel's ``grad_scale``.

[Note: state_dict on several ranks] ``state_dict()`` is a collective: call it on every
rank. It returns torch's AdamW layout with full tensors (plus ``master``, the fp32 master,
for fp16/bf16 params), so a checkpoint from N ranks loads on M ranks, in one process, and
into ``torch.optim.AdamW``. With ``opt.state_dict_rank0_only = True`` only rank 0 keeps the
full tensors.

[Note: DDP] The optimizer averages grads itself; the model needs no DDP wrapper. If the
model *is* wrapped in DDP, its grads are already averaged: set
``opt.grads_already_averaged = True`` (read at every step) and the store only slices them,
saving the second reduction. Averaging already-averaged grads again would give the same
values up to rounding, at the price of a redundant all-reduce.

[Note: a grad on some ranks only] torch skips a param without grad (no step, no weight
decay). Across ranks, a param counts as having a grad when any rank has one (missing grads
count as zeros in the average, as in DDP); ``grads(p)`` answers accordingly so that every
rank increments the same step counters. The answer comes from one small all-reduce per step.

[Note: GradScaler across ranks] GradScaler looks for inf/nan in each rank's *local* grads
(with DDP they are already averaged, so all ranks agree). Here a step pre-hook all-reduces
``found_inf`` so that all ranks skip a step together and the shards stay consistent. The
scaler's own ``update()`` still sees only the local answer: after an overflow on some ranks
only, their loss scales differ, and the summed grads then mix scales. With fp16 and several
ranks, either wrap the model in DDP (grads averaged before the scaler looks; set
``grads_already_averaged``) or expect the loss scales of the ranks to drift apart after a
rank-local overflow. bf16 needs no scaler.

Stage 1 vs 2: both keep 1/N of the fp32 states and of the host grad buffer per rank; they
differ in the collective (all-reduce vs reduce-scatter). ``p.grad`` itself stays full on
every rank (torch's meaning, see above); freeing it after the reduction is not done.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import weakref
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.kernels import get_backend
from offload.memory import BufferPool
from offload.swap.pipeline import idle_votes
from offload.zero import SideStream, comm, split_ranges
from offload.zero.backward_reduce import BackwardReducer
from offload.zero.checkpoint import check_shards, fill_store_from_shards, load_shards, save_shards, save_shards_from_store
from offload.zero.flat_group import LOWP, FlatGroup

__all__ = ["FlatState"]

log = logging.getLogger("offload.optim")


class FlatState:
    """Flat fp32 master and moments on the host, sharded over data-parallel ranks."""

    kind = "flat"
    copy_cpu_grads = False
    """Run the hook + host-grad-buffer path for CPU params too (tests; CUDA always uses it)."""
    overlap = True
    """False: host-to-device copies on the compute stream, synchronous (for comparisons)."""
    stage_cpu_params = False
    """Send CPU bf16/fp16 params through the staging buffer and a copy, as CUDA params go
    (tests: the CUDA path's indexing runs on the CPU too)."""
    side_streams: Optional[Callable[[torch.device], Tuple[Any, Any]]] = None
    """Tests: makes the (grad, copy) pair of stream-like objects for CPU params (an emulation
    of CUDA streams that defers async copies: tests/stream_emulation.py), so the CUDA path's
    stream logic runs in CI. CUDA params always get real ``SideStream`` pairs."""
    reduce_in_backward = False
    """Several ranks: start each bucket's reduction from the grad hooks, during backward (see
    [Note: reduce in backward] in offload/zero/backward_reduce.py); read when the optimizer
    is built. Off by default."""
    inflight = 2
    """Buckets in flight at once when reducing in backward (send buffers kept)."""
    bucket_numel = 1 << 22
    """Elements of each rank's shard moved per collective (bounds the send buffers)."""
    default_sub_group = 1 << 22
    """Elements per kernel call / host-to-device copy when ``sub_group_size`` is not given."""

    @classmethod
    def for_optimizer(cls, opt, *, stage: int, process_group: Any = None) -> "FlatState":
        return cls(opt, stage=stage, process_group=process_group)

    def __init__(self, opt, *, stage: int, process_group: Any = None) -> None:
        self._opt = weakref.ref(opt)
        self.stage = stage
        self.group = process_group
        world, rank = comm.world_and_rank(process_group) if stage > 0 else (1, 0)
        self.world, self.rank = world, rank
        self._backend = opt.backend
        self._threads = opt.num_threads
        # Sub-groups pace the host-to-device pipeline; for CPU params they would only add
        # kernel calls (measured: 25 calls of 4M cost 30 % more than one of 100M), so CPU
        # params are cut only when the user asked for a sub_group_size.
        self._sub_user = opt.config.sub_group_size
        self._sub = opt.config.sub_group_size or self.default_sub_group
        self._comm_dev = comm.comm_device(process_group) if world > 1 else torch.device("cpu")
        self._pools = (BufferPool(pin=False, name=f"flat-state:{id(self):x}"),
                       BufferPool(name=f"flat-state-pinned:{id(self):x}"))  # pinned when CUDA is present
        self._groups: List[FlatGroup] = []
        self._where: Dict[torch.Tensor, Tuple[FlatGroup, int]] = {}
        self._order: List[torch.Tensor] = []  # every param, in param_groups order
        self._hooks = []
        self._streams: Dict[torch.device, Tuple[SideStream, SideStream]] = {}
        weakref.finalize(self, _drain_at_collection, self._streams).atexit = False
        self._mask: Optional[Dict[torch.Tensor, bool]] = None
        self._reduced = False
        self._stash: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        self._closed = False
        self._nvme = opt.config.offload == "nvme"
        self._swap = None
        for group in opt.param_groups:
            self.add_param_group(group)
        if self._nvme:
            self._open_swap(opt)
        self._rib: Optional[BackwardReducer] = None
        me = weakref.ref(self)  # hooks live on the params, which outlive us: never a strong ref
        if self.reduce_in_backward and self.world > 1 and self._groups:
            self._rib = BackwardReducer(self._groups, group=self.group, stage=self.stage, comm_dev=self._comm_dev,
                                        inflight=self.inflight,
                                        disabled=lambda: me() is None or bool(
                                            getattr(me()._opt(), "grads_already_averaged", False)
                                            or getattr(me()._opt(), "_no_sync", False)))
            self._hooks.extend(self._rib.register())
        self._hooks.append(opt.register_step_pre_hook(self._pre_step))
        self._hooks.append(opt.register_load_state_dict_pre_hook(self._pre_load))
        self._hooks.append(opt.register_load_state_dict_post_hook(self._post_load))

    # ------------------------------------------------------------------ construction
    def add_param_group(self, group: Dict[str, Any]) -> None:
        if self._swap is not None:
            raise NotImplementedError("add_param_group is not supported with offload='nvme': give the constructor every group")
        params = [p for p in group["params"] if p not in self._where]
        for p in params:
            if p.dtype not in (torch.float32,) + LOWP:
                raise ValueError(f"parameter of dtype {p.dtype}: only float32, float16 and bfloat16 are supported")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"parameter on {p.device}: only CPU and CUDA params are supported")
            if p.device.type == "cuda" and not p.is_contiguous():
                raise ValueError(f"CUDA parameter of shape {tuple(p.shape)} is not contiguous; "
                                 "the flat store copies updated values into it as one range")
        self._order.extend(params)
        keys: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for p in params:
            keys.setdefault((p.device, p.dtype), []).append(p)
        for (device, _), members in keys.items():
            hook_path = self.world == 1 and (device.type == "cuda" or self.copy_cpu_grads)
            fg = FlatGroup(members, world=self.world, rank=self.rank, pools=self._pools,
                            comm_dev=self._comm_dev, bucket_numel=self.bucket_numel,
                            need_host_grad=hook_path, stage_cpu=self.stage_cpu_params, swapped=self._nvme)
            self._groups.append(fg)
            for i, p in enumerate(members):
                self._where[p] = (fg, i)
                if hook_path and p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))
            if device not in self._streams:
                pair = self._make_side_streams(device)
                if pair is not None:
                    self._streams[device] = pair

    def _make_side_streams(self, device: torch.device) -> Optional[Tuple[Any, Any]]:
        # grad: D2H grad copies, overlapping the rest of backward. copy: H2D param copies,
        # overlapping the CPU kernel of the next sub-group. [Note: streams of the flat
        # store] in offload/zero/streams.py.
        if device.type == "cuda":
            return SideStream(device), SideStream(device)
        if self.side_streams is not None:
            return self.side_streams(device)
        return None

    # ------------------------------------------------------------------ grads in
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: copy the accumulated grad to the host buffer now."""
        g = p.grad
        if g is None or self._closed or getattr(self._opt(), "_no_sync", False):
            return  # inside opt.no_sync(): the grad stays on the device, accumulating
        fg, i = self._where[p]
        lo, hi = fg.layout.slot(i)
        dst = fg.host_grad[lo:hi]
        if self.overlap and g.device in self._streams:
            grad_stream, _ = self._streams[g.device]
            grad_stream.wait_current()  # the grad was produced on the compute stream
            with grad_stream.context():
                dst.copy_(g.detach().reshape(-1), non_blocking=True)
            grad_stream.keep_alive(g)  # keep g's memory until the copy has read it
        else:
            dst.copy_(g.detach().reshape(-1))
        sumsq = None
        if g.device in self._streams and getattr(self._opt(), "max_grad_norm", None) is not None:
            # [Note: device grad norm] With clipping, the grad's sum of squares is taken here,
            # on the device (a reduction at its memory bandwidth, on the stream that made the
            # grad), so the step needs no pass of the host over the copied grads. It belongs
            # to this version of this grad: a later change (another micro-batch re-fires the
            # hook; an in-place op moves the version) falls back to the host's pass.
            sumsq = torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square()  # no fp32 overflow
        fg.grad_tag[i] = (weakref.ref(g), g._version, sumsq)

    @staticmethod
    def _tag_current(tag: Any, g: torch.Tensor) -> bool:
        return tag is not None and tag[0]() is g and tag[1] == g._version

    def _host_grad(self, fg: FlatGroup, i: int, g: torch.Tensor) -> torch.Tensor:
        """The host copy of p.grad (the hook's, or a fresh one when it is stale)."""
        lo, hi = fg.layout.slot(i)
        dst = fg.host_grad[lo:hi]
        if not self._tag_current(fg.grad_tag[i], g):
            dst.copy_(g.detach().reshape(-1))
            fg.grad_tag[i] = (weakref.ref(g), g._version, None)
        return dst

    def _wait_grad_copies(self) -> None:
        for grad_stream, _ in self._streams.values():
            grad_stream.synchronize()

    def _drain(self) -> None:
        """Wait for every side-stream copy. step() returns with param copies still queued
        that read the pinned master / staging buffers: any host write to those outside
        step() (a load) must come after them, or the device gets the new bytes half-way."""
        _drain_streams(self._streams)

    def _pre_step(self, opt, args, kwargs) -> None:
        """Step pre-hook: a new step; make the skip decision of GradScaler global."""
        self._mask = None
        self._reduced = False
        found_inf = getattr(opt, "found_inf", None)
        if found_inf is not None and getattr(opt, "grad_scale", None) is None:
            # GradScaler.unscale_() ran: it divides the grads in place with an op that does
            # not bump their version counters, so copies made before it look current.
            # Forget them all: grads are copied / reduced again at this step.
            for fg in self._groups:
                fg.grad_tag = [None] * len(fg.params)
            if self._rib is not None:
                self._rib.forget()
        if self.world > 1 and isinstance(found_inf, torch.Tensor):
            # GradScaler checks each rank's local grads; a step must be skipped on all
            # ranks or on none, or the shards diverge. (The loss scale itself is still
            # updated from the local check: see [Note: GradScaler across ranks].)
            flag = found_inf.detach().to(self._comm_dev, torch.float32).reshape(1).clone()
            comm.all_reduce(flag, self.group, op=torch.distributed.ReduceOp.MAX)
            opt.found_inf = flag.to(found_inf.device).reshape(found_inf.shape)

    def _grad_mask(self) -> Dict[torch.Tensor, bool]:
        if self._mask is None:
            have = torch.tensor([p.grad is not None for p in self._order], dtype=torch.int32,
                                device=self._comm_dev)
            comm.all_reduce(have, self.group, op=torch.distributed.ReduceOp.MAX)
            self._mask = {p: bool(h) for p, h in zip(self._order, have.tolist())}
        return self._mask

    _ELSEWHERE = torch.zeros(0)
    """Stands for a grad that exists on another rank only (this rank contributes zeros)."""

    def grads(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        if self.world == 1:
            return p.grad
        have = self._grad_mask()[p]  # collective on the first call of a step, on every rank
        if p.grad is not None:
            return p.grad
        return self._ELSEWHERE if have else None

    def _reduce(self) -> None:
        """Average grads across ranks into each group's fp32 shard buffer (see the notes)."""
        if self._reduced:
            return
        self._grad_mask()  # every rank agrees on which params have a grad this step
        only_slice = bool(getattr(self._opt(), "grads_already_averaged", False))
        # The shard buffers hold the sum over ranks (folded into the kernel as 1/N) or,
        # after DDP, the average already.
        self._factor = 1.0 if only_slice else 1.0 / self.world
        if self._rib is not None and not only_slice:
            self._rib.finish()  # started during backward: [Note: reduce in backward]
        else:
            for fg in self._groups:
                fg.reduce_grads(self.group, self.stage, only_slice)
        self._reduced = True

    def prepare_grads(self) -> None:
        """Make this step's grads ready where the kernel reads them (the optimizer times this
        as grad_transfer): the cross-rank reduction, or the pending host copies."""
        if self.world > 1:
            self._reduce()
        else:
            self._wait_grad_copies()

    def global_grad_sumsq(self, work) -> Tuple[float, bool]:
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
            return s * self._factor * self._factor, bad > 0
        self._wait_grad_copies()
        total, nonfinite = 0.0, False
        on_device: Dict[torch.device, List[torch.Tensor]] = {}
        for _, items in work:
            for p, g in items:
                fg, i = self._where[p]
                tag = fg.grad_tag[i] if fg.host_grad is not None else None
                if self._tag_current(tag, g) and tag[2] is not None:  # [Note: device grad norm]
                    on_device.setdefault(tag[2].device, []).append(tag[2])
                    continue
                src = self._host_grad(fg, i, g) if fg.host_grad is not None else _flat_cpu(g)
                if src.numel():
                    s, bad = kernel.grad_sumsq(src, num_threads=self._threads)
                    total += s
                    nonfinite |= bad
        for parts in on_device.values():
            s = float(torch.stack(parts).double().sum())  # one synchronisation per device
            nonfinite |= not math.isfinite(s)
            total += s
        return total, nonfinite

    # ------------------------------------------------------------------ the step
    def step(self, batches) -> Dict[str, float]:
        t0 = time.perf_counter()
        if self.world > 1:
            self._reduce()
        else:
            self._wait_grad_copies()
        t_grads = time.perf_counter() - t0
        kernel = get_backend(self._backend)
        for _, copy_stream in self._streams.values():
            # The H2D copies below overwrite params that kernels queued on the compute
            # stream may still read, and reuse staging the last step's copies may still read.
            copy_stream.synchronize()
            copy_stream.wait_current()
        if self._nvme:
            return self._step_swapped(batches, t_grads)
        if self.world > 1:
            return self._step_partitioned(kernel, batches, t_grads)
        t_kernel = t_h2d = 0.0
        for hyper, items in batches:
            kw_base = None
            for p, g, step in items:
                fg, i = self._where[p]
                if kw_base is None or kw_base[0] != step:
                    kw_base = (step, hyper.kernel_kwargs(step))
                tk, th = self._step_param(kernel, fg, i, g, kw_base[1])
                t_kernel += tk
                t_h2d += th
        for _, copy_stream in self._streams.values():
            copy_stream.current_waits()  # the next forward reads the params copied above
        return {"grad_transfer": t_grads, "kernel": t_kernel, "h2d": t_h2d, "allgather": 0.0}

    # [Note: all-gather overlap] Several ranks: the shard is stepped bucket by bucket (the
    # buckets of the grad reduction) and each bucket's all-gather starts as soon as its
    # kernel is done, so it travels while the CPU computes the next bucket; two are in
    # flight at once (gather slots 0 and 1, see FlatGroup.all_gather_bucket_async). Every
    # rank gathers every bucket in the same order (a collective), whether or not its own
    # part of the bucket had grads. With NCCL the gather runs on NCCL's stream; with gloo on
    # gloo's thread.
    def _step_partitioned(self, kernel, batches, t_grads: float) -> Dict[str, float]:
        kws: Dict[Tuple[int, int], dict] = {}
        for hyper, items in batches:
            hyper = dataclasses.replace(hyper, grad_scale=hyper.grad_scale * self._factor)
            by_step: Dict[int, dict] = {}
            for p, _, step in items:
                fg, i = self._where[p]
                if step not in by_step:
                    by_step[step] = hyper.kernel_kwargs(step)
                kws[(id(fg), i)] = by_step[step]
        t_kernel = t_ag = 0.0
        for fg in self._groups:
            start = fg.layout.shard_range()[0]
            pending = deque()
            for k, (a, b) in enumerate(fg.bucket_ranges()):
                t = time.perf_counter()
                for pc in fg.layout.pieces(start + a, start + b):
                    kw = kws.get((id(fg), pc.index))
                    if kw is None:
                        continue  # no grad on any rank this step: not stepped (as torch)
                    s = slice(pc.lo - start, pc.hi - start)
                    kernel.adam_step(fg.master[s], fg.gshard[s], fg.exp_avg[s], fg.exp_avg_sq[s],
                                     param_lowp=fg.lowp_shard[s] if fg.lowp else None,
                                     num_threads=self._threads, **kw)
                t1 = time.perf_counter()
                t_kernel += t1 - t
                if len(pending) == 2:
                    work, finish = pending.popleft()
                    work.wait()
                    finish()
                pending.append(fg.all_gather_bucket_async(a, b, k % 2, self.group))
                t_ag += time.perf_counter() - t1
            t = time.perf_counter()
            while pending:
                work, finish = pending.popleft()
                work.wait()
                finish()
            t_ag += time.perf_counter() - t
        return {"grad_transfer": t_grads, "kernel": t_kernel, "h2d": 0.0, "allgather": t_ag}

    def _step_param(self, kernel, fg: FlatGroup, i: int, g: torch.Tensor, kw: dict) -> Tuple[float, float]:
        """One rank: step param ``i`` (cut into sub-groups for CUDA params) and send it."""
        piece = fg.layout.owned(i)
        if piece is None:
            return 0.0, 0.0
        start = fg.layout.shard_range()[0]
        off = fg.layout.offsets[i]
        p = fg.params[i]
        if fg.host_grad is not None:
            grad, gbase = self._host_grad(fg, i, g), -off
        else:
            grad, gbase = _flat_cpu(g), -off
        pflat = fg.flat_param(i)
        copy_back = False
        if pflat is None:  # non-contiguous CPU param: update a copy
            pflat, copy_back = p.detach().reshape(-1).clone(), True
        # Where the kernel writes the low-precision copy of the updated master, and what
        # goes to the param after the kernel.
        lowp, lbase, send = None, 0, None
        if fg.stage is not None:
            lowp, lbase, send = fg.stage, -start, fg.stage  # CUDA bf16/fp16: via pinned staging
        elif fg.lowp:
            lowp, lbase = pflat, -off  # CPU bf16/fp16: straight into the param
        else:
            send = fg.master  # fp32 params: the master itself is copied
        t_kernel = t_h2d = 0.0
        sub = self._sub if (p.device in self._streams or self._sub_user) else piece.numel
        for a, b in split_ranges(piece.lo, piece.hi, sub):
            s = slice(a - start, b - start)
            t = time.perf_counter()
            kernel.adam_step(
                fg.master[s], grad[a + gbase:b + gbase], fg.exp_avg[s], fg.exp_avg_sq[s],
                param_lowp=None if lowp is None else lowp[a + lbase:b + lbase],
                num_threads=self._threads, **kw)
            t_kernel += time.perf_counter() - t
            if send is not None:
                # Send this sub-group to the param; on CUDA the copy stream does it while
                # the CPU computes the next sub-group.
                t = time.perf_counter()
                self._to_param(pflat[a - off:b - off], send[s])
                t_h2d += time.perf_counter() - t
        if copy_back:
            p.detach().copy_(pflat.view_as(p))
        return t_kernel, t_h2d

    # [Note: nvme] With offload="nvme" this rank's shards of the fp32 master, exp_avg and
    # exp_avg_sq all live in swap files (SwappedShards in swapped_shards.py: the groups'
    # shards end to end, streamed read g+1 / compute g / write g-1). Host memory keeps the
    # pipeline buffers, the grads and the low-precision copies. Each (param ∩ shard) piece is
    # one work item whose output is where the updated values go (see _piece_output): the
    # kernel writes the bf16/fp16 copy straight into the param (CPU), into the staging buffer
    # (CUDA, copied to the device after the swapped step) or into the shard that is
    # all-gathered; fp32 params get the master copied into them. fp32 CPU params of a
    # partitioned group thus keep their master in the swap files too (4 B/param more disk
    # traffic than updating them in place; the in-place path is the stage-0 SwappedState).
    def _open_swap(self, opt) -> None:
        cfg = opt.config
        # Several ranks: the swap steps' vote (see [Note: ranks vote before commit] in
        # swap/pipeline.py), also cast by a rank that holds no element at all.
        self._swap_vote = functools.partial(comm.failed_ranks, group=self.group) if self.world > 1 else None

        def open_local() -> None:
            from offload.optim.swapped_shards import SwappedShards, flat_identity

            sizes = [fg.layout.shard for fg in self._groups]
            if not sum(sizes):
                return  # no element at all on this rank
            me = weakref.ref(self)
            identity = flat_identity(self.world, self.rank, self._groups)
            self._swap = SwappedShards(sizes, swap_dir=cfg.swap_dir, identity=identity,
                                       extra=lambda: {"steps": me()._ckpt_steps() if me() is not None else []},
                                       max_host_bytes=cfg.max_host_bytes, sub_group_size=cfg.sub_group_size,
                                       verify=cfg.verify, resume=cfg.resume, io_engine=cfg.io,
                                       backend=self._backend, num_threads=self._threads, rank=self.rank,
                                       run_name="flat", vote=self._swap_vote)
            if self._swap.resumed:  # resume="auto" chose, "discard" never resumes ([Note: restarts] in swap/runs)
                # The master of the last finished step is the truth: steps and params follow it.
                self._set_steps(self._swap.resumed_extra.get("steps") or [])
            else:
                self._swap.initialise(lambda k, lo, hi, out: self._groups[k].shard_values(lo, hi, out))

        try:
            # Several ranks agree before anything collective follows: a rank that cannot open
            # or resume its swap files (a full disk, a missing directory) makes every rank raise.
            comm.on_every_rank(open_local, f"opening the swap files in {cfg.swap_dir!r}", self.group, self.world)
            if cfg.resume is True or (self._swap is not None and self._swap.resumed):  # "auto": one rank only
                self._params_from_swap()  # every rank: an all-gather when partitioned
        except BaseException:
            if self._swap is not None:
                self._swap.close(remove=not self._swap.resumed)  # keep what we were asked to resume
                self._swap = None
            raise

    def _piece_output(self, fg: FlatGroup, i: int, pc, start: int):
        """(out, mode, post) for piece ``pc`` of param ``i``: where the updated master goes
        (see [Note: outputs] in swapped_shards.py) and what runs after the swapped step."""
        s = slice(pc.lo - start, pc.hi - start)
        p = fg.params[i]
        if self.world > 1 and fg.lowp:
            return fg.lowp_shard[s], "lowp", None  # all-gathered afterwards
        flat = p.detach().view(-1) if p.is_contiguous() else None
        dst = None if flat is None else flat[pc.param_offset:pc.param_offset + pc.numel]
        if fg.stage is not None:  # one rank, device bf16/fp16: via the pinned staging
            stage = fg.stage[s]
            return stage, "lowp", lambda: self._to_param(
                p.detach().view(-1)[pc.param_offset:pc.param_offset + pc.numel], stage)
        if dst is not None:
            return dst, ("lowp" if fg.lowp else "copy"), None
        tmp = torch.empty(pc.numel, dtype=p.dtype)  # non-contiguous CPU param: via a copy

        def put_back() -> None:
            whole = p.detach().reshape(-1).clone()
            whole[pc.param_offset:pc.param_offset + pc.numel].copy_(tmp)
            p.detach().copy_(whole.view_as(p))
        return tmp, ("lowp" if fg.lowp else "copy"), put_back

    def _to_param(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Updated values -> (a range of) a param; for a CUDA param on its device's copy
        stream, so the CPU goes on with the next sub-group meanwhile."""
        _, copy_stream = self._streams.get(dst.device, (None, None))
        if copy_stream is not None and self.overlap:
            with copy_stream.context():
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def _all_outputs(self):
        outs, posts = [], []
        for k, fg in enumerate(self._groups):
            start = fg.layout.shard_range()[0]
            for i in range(len(fg.params)):
                pc = fg.layout.owned(i)
                if pc is not None:
                    out, mode, post = self._piece_output(fg, i, pc, start)
                    outs.append((k, pc.lo - start, pc.hi - start, out, mode))
                    if post is not None:
                        posts.append(post)
        return outs, posts

    def _params_from_swap(self) -> None:
        """Every param <- its master in the swap files (resume, load_checkpoint)."""
        def emit() -> None:
            if self._swap is not None:
                outs, posts = self._all_outputs()
                self._swap.emit_all(outs)
                for post in posts:
                    post()

        # A rank whose swap reads fail must not leave the others in the all-gather below.
        comm.on_every_rank(emit, "rebuilding the params from the swap files", self.group, self.world)
        if self.world > 1:
            for fg in self._groups:
                fg.all_gather_params(self.group)
        for _, copy_stream in self._streams.values():
            copy_stream.current_waits()

    def _step_swapped(self, batches, t_grads: float) -> Dict[str, float]:
        index = {id(fg): k for k, fg in enumerate(self._groups)}
        items, posts = [], []
        for hyper, batch in batches:
            if self.world > 1:
                hyper = dataclasses.replace(hyper, grad_scale=hyper.grad_scale * self._factor)
            for p, g, step in batch:
                fg, i = self._where[p]
                pc = fg.layout.owned(i)
                if pc is None:
                    continue
                start = fg.layout.shard_range()[0]
                ps = slice(pc.param_offset, pc.param_offset + pc.numel)
                if self.world > 1:
                    grad = fg.gshard[pc.lo - start:pc.hi - start]
                elif fg.host_grad is not None:
                    grad = self._host_grad(fg, i, g)[ps]
                else:
                    grad = _flat_cpu(g)[ps]
                out, mode, post = self._piece_output(fg, i, pc, start)
                items.append((index[id(fg)], pc.lo - start, pc.hi - start, grad, hyper.kernel_kwargs(step), out, mode))
                if post is not None:
                    posts.append(post)
        # Several ranks: every rank steps and votes (see [Note: ranks vote before commit] in
        # swap/pipeline.py), even with nothing of its own to step or no element at all.
        phases: Dict[str, float] = {}
        if self._swap is not None and (items or self.world > 1):
            phases = dict(self._swap.step(items))
        elif self._swap_vote is not None:
            idle_votes(self._swap_vote)
        t = time.perf_counter()
        for post in posts:  # staging -> device (async on the copy stream), or non-contiguous params
            post()
        phases["h2d"] = time.perf_counter() - t
        t = time.perf_counter()
        if self.world > 1:
            for fg in self._groups:
                fg.all_gather_params(self.group)
        phases["allgather"] = time.perf_counter() - t
        phases["grad_transfer"] = t_grads
        for _, copy_stream in self._streams.values():
            copy_stream.current_waits()  # the next forward reads the params copied above
        return phases

    # ------------------------------------------------------------------ state_dict
    def _has_state(self, p: torch.Tensor) -> bool:
        opt = self._opt()
        return opt is not None and "step" in opt.state.get(p, {})

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The full fp32 master of ``p`` (gathered across ranks: call on every rank)."""
        return self._gather_full(p, ("master",))["master"]

    def export_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        if not self._has_state(p):
            return {}
        fg, _ = self._where[p]
        keys = ("exp_avg", "exp_avg_sq") + (("master",) if fg.lowp else ())
        # opt.state_dict_rank0_only = True: every rank takes part in the gather, only rank 0
        # keeps the full tensors (the others' state_dict() then holds only the steps).
        keep = self.rank == 0 or not getattr(self._opt(), "state_dict_rank0_only", False)
        out = self._gather_full(p, keys, keep=keep)
        return out if keep else {}

    def _gather_full(self, p: torch.Tensor, keys, keep: bool = True) -> Dict[str, torch.Tensor]:
        """Full-shaped fp32 copies of this param's states; collective when partitioned."""
        fg, i = self._where[p]
        off, n = fg.layout.offsets[i], fg.layout.numels[i]
        full = torch.empty(len(keys), n if keep else 0, dtype=torch.float32)
        S = fg.layout.shard
        for r in range(self.world):
            a, b = max(off, r * S), min(off + n, (r + 1) * S)
            if a >= b:
                continue
            part = torch.empty(len(keys), b - a, dtype=torch.float32, device=self._comm_dev)
            if r == self.rank:
                if fg.swapped:
                    vals = self._swap.read(self._groups.index(fg), a - r * S, b - r * S, keys)
                else:
                    vals = {key: getattr(fg, key)[a - r * S:b - r * S] for key in keys}
                for k, key in enumerate(keys):
                    part[k].copy_(vals[key])
            comm.broadcast(part, r, self.group)
            if keep:
                full[:, a - off:b - off].copy_(part)
        if not keep:
            return {}
        return {key: full[k].view_as(p).clone() for k, key in enumerate(keys)}

    def import_state(self, p: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        # torch's load_state_dict casts floating state to the param's dtype; the pre-load
        # hook kept the original (fp32) tensors, which we prefer.
        full = dict(state)
        full.update(self._stash.get(p, {}))
        fg, i = self._where[p]
        piece = fg.layout.owned(i)
        if piece is None:
            return
        start = fg.layout.shard_range()[0]
        s = slice(piece.lo - start, piece.hi - start)
        ps = slice(piece.param_offset, piece.param_offset + piece.numel)
        if fg.swapped:
            vals = {key: full[key].detach().reshape(-1)[ps].float() for key in ("exp_avg", "exp_avg_sq") if key in full}
            if vals:
                self._swap.write(self._groups.index(fg), s.start, s.stop, vals)
            return
        for key in ("exp_avg", "exp_avg_sq"):
            if key in full:
                getattr(fg, key)[s].copy_(full[key].detach().reshape(-1)[ps])

    def reset_state(self, p: torch.Tensor) -> None:
        """Zero moments for ``p`` (loading a state_dict without state for it; as torch)."""
        if p not in getattr(self, "_stepped", ()):
            return  # never stepped: its moments are zeros already (no swap read-modify-write)
        fg, i = self._where[p]
        piece = fg.layout.owned(i)
        if piece is None:
            return
        start = fg.layout.shard_range()[0]
        lo, hi = piece.lo - start, piece.hi - start
        if fg.swapped:
            z = torch.zeros(hi - lo, dtype=torch.float32)
            self._swap.write(self._groups.index(fg), lo, hi, {"exp_avg": z, "exp_avg_sq": z})
        else:
            fg.exp_avg[lo:hi].zero_()
            fg.exp_avg_sq[lo:hi].zero_()

    def _pre_load(self, opt, state_dict):
        self._drain()  # what follows (here, _post_load, import/reset_state) rewrites host buffers
        # Params that have moments now (before torch replaces opt.state): only those need
        # reset_state() when the loaded dict has no state for them; the others hold zeros.
        self._stepped = {p for p in self._order if self._has_state(p)}
        self._stash = {}
        order = [p for g in opt.param_groups for p in g["params"]]
        index = dict(enumerate(order))
        for k, st in state_dict.get("state", {}).items():
            p = index.get(k)
            if p is None or p not in self._where:
                continue
            self._stash[p] = {key: st[key] for key in ("exp_avg", "exp_avg_sq", "master")
                              if isinstance(st.get(key), torch.Tensor)}
        return None

    def _post_load(self, opt) -> None:
        """Masters from the checkpoint where it has them, else from the params' values."""
        for k, fg in enumerate(self._groups):
            fg.refresh_master()
            start, end = fg.layout.shard_range()
            for pc in fg.layout.pieces(start, end):
                p = fg.params[pc.index]
                st = opt.state.get(p)
                if st is not None:
                    st.pop("master", None)  # torch cast it to the param dtype; we keep fp32
                m = self._stash.get(p, {}).get("master")
                s = slice(pc.lo - start, pc.hi - start)
                if m is not None:
                    m = m.detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel].float()
                elif fg.swapped:
                    m = p.detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel].float()
                if m is None:
                    continue
                if fg.swapped:
                    self._swap.write(k, s.start, s.stop, {"master": m})
                    if fg.lowp_shard is not None:
                        fg.lowp_shard[s].copy_(m)
                else:
                    fg.master[s].copy_(m)
            if not fg.swapped:
                fg.refresh_lowp_shard()
        for p in self._order:
            st = opt.state.get(p)
            if st is not None:
                st.pop("master", None)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_steps(self) -> List[int]:
        opt = self._opt()
        return [int(opt.state[p]["step"].item()) if "step" in opt.state.get(p, {}) else 0 for p in self._order]

    def _set_steps(self, steps: List[int]) -> None:
        opt = self._opt()
        if len(steps) != len(self._order):
            raise ValueError(f"{len(steps)} step counts for {len(self._order)} params")
        for p, step in zip(self._order, steps):
            if step:
                opt.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
            elif p in opt.state:  # (opt.state is a defaultdict: do not create entries)
                opt.state[p].pop("step", None)
                if not opt.state[p]:
                    del opt.state[p]

    def save_checkpoint(self, directory: str, extra: Optional[Dict[str, Any]] = None) -> None:
        """Per-rank shards + meta (see [Note: flat checkpoints] in offload/zero/checkpoint.py);
        with offload="nvme" streamed from the swap files; all ranks or none ([Note: shards saved all or none])."""
        meta = dict(extra or {}, steps=self._ckpt_steps())
        if self._swap is not None:
            swap, layouts = self._swap, [fg.layout for fg in self._groups]  # flushed in the voted half
            save_shards_from_store(directory, swap.store, swap.pipeline.buffers, layouts=layouts, meta=meta,
                                   process_group=self.group, before=lambda: swap.save(lambda s, b: None))
            return
        save_shards(directory, self._groups, world=self.world, rank=self.rank, meta=meta, process_group=self.group)

    def load_checkpoint(self, directory: str) -> None:
        """Masters, moments and steps from a checkpoint of any world size; params follow.

        All or nothing, on every rank: a rank that cannot load (a missing or corrupt file, a
        full swap disk) makes every rank raise with its optimizer as it was, instead of
        leaving the others in the params' all-gather or half loaded. With offload="nvme" the
        checkpoint streams into the free swap slots, and the ranks vote before and after the
        commit as for a step ([Note: ranks vote before commit] in swap/pipeline.py). In host
        memory, every file this rank needs is read through and its crc32 checked first, the
        ranks agree, and only then are the states overwritten; only an I/O error in that
        second read (or a file changed between the two) can still leave them half loaded, and
        the error says so."""
        self._drain()
        steps_before = self._ckpt_steps()
        layouts = [fg.layout for fg in self._groups]
        if self._swap is not None:
            try:
                self._swap.load_checkpoint(
                    lambda store, bufs: fill_store_from_shards(directory, layouts, store, bufs),
                    lambda meta: self._set_steps(meta.get("steps") or [0] * len(self._order)), vote=self._swap_vote)
            except BaseException:
                # The steps the swap files hold: the old ones, unless undoing a commit failed
                # (then the checkpoint's; the error says to load again).
                held = self._swap.store.extra.get("steps")
                self._set_steps(held if held is not None else steps_before)
                raise
            self._params_from_swap()
            return
        what = f"load_checkpoint({directory!r})"
        if self._nvme:  # offload="nvme", no element on this rank: only the steps, voted as the others
            def undo() -> str:
                self._set_steps(steps_before)
                return "nothing was loaded on any rank"

            comm.all_or_none(lambda: check_shards(directory, layouts),
                             lambda meta: self._set_steps(meta.get("steps") or [0] * len(self._order)),
                             undo, what, self._swap_vote)
            return
        comm.on_every_rank(lambda: check_shards(directory, layouts), what + " (nothing was loaded on any rank)",
                           self.group, self.world)

        half = "the optimizer state is incomplete until it is loaded again"

        def load() -> None:
            try:
                meta = load_shards(directory, self._groups)
            except Exception as exc:  # after the check passed: a read error, or files changed since
                raise _with_hint(exc, half) from exc
            self._set_steps(meta.get("steps") or [0] * len(self._order))

        comm.on_every_rank(load, f"{what} ({half})", self.group, self.world)
        for fg in self._groups:
            fg.write_params(self.group)

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> Dict[str, int]:
        host = {"states": 0, "grads": 0, "lowp": 0}
        device = 0
        for fg in self._groups:
            nb = fg.nbytes()
            for k in host:
                host[k] += nb[k]
            if self._comm_dev.type == "cuda":
                device += nb["comm"]
            else:
                host["grads"] += nb["comm"]
        total = sum(host.values())
        pinned = sum(buf.nbytes for fg in self._groups for _, buf in fg._bufs if buf.pinned)
        nvme = io_locked = 0
        if self._swap is not None:
            sw = self._swap.memory_report()
            pinned += sw["pinned"]
            total += sw["pinned"] + sw["pageable"]
            nvme, io_locked = sw["nvme"], sw["io_locked_bytes"]
        return {"device": device, "pinned": pinned, "pageable": total - pinned, "nvme": nvme,
                "io_locked_bytes": io_locked,
                "state_bytes": host["states"], "grad_bytes": host["grads"], "lowp_bytes": host["lowp"],
                "world": self.world, "rank": self.rank, "stage": self.stage,
                "shard_numel": sum(fg.layout.shard for fg in self._groups)}

    def close(self, keep_swap: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_rib", None) is not None:
            self._rib.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drain()
        if self._swap is not None:
            self._swap.close(remove=not keep_swap)  # keep_swap: for resume=True
            self._swap = None
        for fg in self._groups:
            fg.close()
        self._groups = []
        self._stash = {}
        try:
            for pool in self._pools:
                pool.close()
        except BufferError as exc:  # a caller still holds a view; the OS reclaims it at exit
            log.warning("flat store: %s", exc)


def _with_hint(exc: Exception, hint: str) -> Exception:
    """``exc`` again, of its own type where that is simple, with ``hint`` added to its text."""
    if isinstance(exc, OSError):
        return type(exc)(exc.errno, f"{exc.strerror or exc}; {hint}", exc.filename)
    if type(exc) in (ValueError, RuntimeError, KeyError, TypeError):
        return type(exc)(f"{exc}; {hint}")
    return RuntimeError(f"{type(exc).__name__}: {exc}; {hint}")


def _drain_streams(streams: Dict[torch.device, Tuple[SideStream, SideStream]]) -> None:
    for grad_stream, copy_stream in streams.values():
        grad_stream.synchronize()
        copy_stream.synchronize()


def _drain_at_collection(streams: Dict[torch.device, Tuple[SideStream, SideStream]]) -> None:
    # An optimizer dropped without close(): its pools unpin and unmap their buffers when they
    # are collected, right after this runs (weakref callbacks come first), and a copy still
    # queued on a side stream must not find its memory gone.
    try:
        _drain_streams(streams)
    except Exception as exc:  # CUDA already torn down: nothing is queued any more
        log.debug("flat store: draining side streams at collection: %s", exc)


def _weak_hook(store: "FlatState"):
    """A grad hook that reaches the store through a weak reference: a param (which outlives
    the optimizer) must not keep the store, its buffers and its swap files alive."""
    ref = weakref.ref(store)

    def hook(p: torch.Tensor) -> None:
        s = ref()
        if s is not None:
            s._grad_ready(p)
    return hook


def _flat_cpu(g: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous CPU view (or copy) of a grad."""
    if g.device.type != "cpu":
        g = g.detach().to("cpu")
    return g.detach().reshape(-1) if g.is_contiguous() else g.detach().contiguous().view(-1)
