"""The module hooks: gather before a unit's forward and backward, release after, reduce its
grads when its backward is done (FSDP2's pre/post forward and backward, on the CPU).

- pre-forward (``register_forward_pre_hook``): the root's opens the forward phase of the
  gather schedule (schedule.py); every unit's acquires its params, and, when grad is
  enabled, routes the inputs that require grad through ``_PostBackward``, whose backward
  runs once autograd is past the unit (its params' grads are accumulated by then: the
  engine runs a leaf's AccumulateGrad as soon as it is ready).
- post-forward: a pre-backward hook on the outputs (``register_multi_grad_hook``, any
  output's grad), then the unit is released (the root stays live until the backward ends,
  as FSDP2 keeps it); the root's post-forward closes the forward phase.
- pre-backward: opens the backward phase (once) and queues the final callback; acquires.
- post-backward: after a unit's last use, release it and hand its grads to the reducer.
- final callback: the units whose backward never reached ``_PostBackward`` (inputs that do
  not require grad, e.g. token ids) are done now; the phase's final round; the remaining
  reductions (grads.py [Note: reduce order]).
- a unit's forward run again during the backward (activation checkpointing): recompute.py
  [Note: activation checkpointing].
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.shard.entries import entry_modules
from offload.shard.grads import GradReducer
from offload.shard.guards import refuse_copy, refuse_ddp_above
from offload.shard.recompute import Recomputes, in_autograd_backward, reentrant_recompute
from offload.shard.schedule import GatherSchedule, order_hash
from offload.shard.splits import warn_no_decay_lost

__all__ = ["ShardRuntime"]


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, unit, gen, *inputs):
        ctx.runtime, ctx.unit, ctx.gen = runtime, unit, gen
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.runtime.post_backward(ctx.unit, ctx.gen)
        return (None, None, None) + grads


def _grad_tensors(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            if t.requires_grad:
                out.append(t)
        elif isinstance(t, Mapping):  # a dict subclass pytree does not know (an HF ModelOutput)
            out += _grad_tensors(list(t.values()))
    return out


def _eager(hook: Any) -> Any:
    """``hook``, never traced by ``torch.compile``: a compiled module (``block.compile()``,
    ``torch.compile(block)``) compiles its hooks with its forward, and dynamo then traced the
    gather schedule, the collectives and the param tier frame by frame (numpy over a swap
    file's pages failed inside dynamo with an AssertionError, offload_params="nvme"). A hook
    changes the runtime's state and issues I/O and collectives: it runs eagerly, a graph break
    on each side of it, and the forward between the hooks is compiled. Eager calls pay one
    flag read (torch._dynamo is imported only by a compile)."""
    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            import torch._dynamo as dynamo

            return dynamo.disable(hook, recursive=True)(*args, **kwargs)
        return hook(*args, **kwargs)
    return run


def _destroy_group(group: Any) -> None:
    """Destroy a process group made for one sharded model ([Note: the reduce group's end]).
    Nothing when torch.distributed went first (``destroy_process_group()`` destroys every
    group; torch then calls ``group`` invalid)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": already destroyed
        pass


class ShardRuntime:
    """The hooks' state for one sharded root module.

    [Note: the reduce group's end] ``offload.shard`` makes a group of its own for the
    reduce-scatters (api.py ``_reduce_group``), one per call: never shared, since two models
    in one backward would interleave their reductions on it. It is destroyed by
    :meth:`remove` or when the runtime is collected (the model and the optimizer over its
    params gone), so that a program sharding many models does not keep a group (sockets,
    threads) for each. In torch 2.13 ``destroy_process_group(subgroup)`` is local (no
    barrier, no store: bookkeeping and the backend's ``shutdown()``), so each rank may do
    it when its GC gets there; that holds for gloo, whose shutdown closes its own pairs.
    NCCL's communicator teardown was collective in some NCCL versions: a group of another
    backend than gloo is destroyed only by ``remove()``, which every rank calls.
    """

    def __init__(self, units: List[Any], *, group: Any, reduce_group: Any, world: int, rank: int,
                 prefetch: int = 1, budget: Optional[int] = None, budget_in_bytes: bool = True,
                 own_reduce: bool = False) -> None:
        self.units = units
        self.world, self.rank = world, rank
        self.schedule = GatherSchedule(units, group, world, rank, prefetch=prefetch, budget=budget,
                                       in_bytes=budget_in_bytes)
        self.reducer = GradReducer(units, reduce_group, world)
        self.recomputes = Recomputes(self.schedule)  # [Note: activation checkpointing] in recompute.py
        self.in_forward = False
        self.in_backward = False
        # the module whose forward opened the current forward of the model: the root or an entry
        # ([Note: forwards entered below the root] in entries.py); still set after it raised
        self._opener: Optional[Any] = None
        self._holders: "set[int]" = set()
        # [Note: one backward per forward] the root forward's number, and the last one whose
        # backward finished: a backward through an older forward's graph (two forwards, then
        # one backward of both; a forward, even under no_grad, between a forward and its
        # backward) or through a finished one's again (retain_graph=True) would find the units'
        # uses spent (``_drop_stale``, ``post_backward``) and its grads never reduced: wrong
        # grads, silently. It raises instead.
        self.fwd_gen = 0
        self.bwd_done_gen = -1
        self.sync_grads = True  # False: accumulate the full grads locally (no_sync)
        self.ctx: Optional[Any] = None  # an optimizer's StepContext, whose no_sync we follow
        self._handles: List[Any] = []
        self._ddp_passed: "weakref.WeakSet[Any]" = weakref.WeakSet()  # guards.refuse_ddp_above
        self.tier: Optional[Any] = None  # the ParamTier (tier.py): params on NVMe, or grads with states there
        self.params_on_disk = False
        self._group_end: Optional[Any] = None  # the reduce group's destroyer, when it is ours
        if own_reduce:
            self.own_group(reduce_group)

    __reduce_ex__ = refuse_copy  # deepcopy / pickle of the model: guards.py [Note: calls on a sharded model]

    def own_group(self, group: Any) -> None:
        """``group`` was made for this runtime alone: see [Note: the reduce group's end]."""
        self._group_end = weakref.finalize(self, _destroy_group, group)
        self._group_end.atexit = False  # at exit the process's groups go anyway, maybe before us
        if dist.get_backend(group) != "gloo":
            self._group_end.detach()  # only remove() destroys it
            self._group_end = functools.partial(_destroy_group, group)

    def install(self) -> None:
        for u in self.units:
            self._handles.append(u.module.register_forward_pre_hook(
                _eager(functools.partial(self.pre_forward, u)), with_kwargs=True))
            self._handles.append(u.module.register_forward_hook(_eager(functools.partial(self.post_forward, u))))
            # after post_forward, and also when the forward raised (a recompute stopped early)
            self._handles.append(u.module.register_forward_hook(_eager(functools.partial(self.recompute_exit, u)),
                                                                always_call=True))
        containers, holders = entry_modules(self.units)
        self._holders = {id(m) for m in holders}
        for m in containers + holders:
            self._handles.append(m.register_forward_pre_hook(self.entry_enter, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self.entry_exit))
        for m in [self.units[0].module] + containers + holders:  # after post_forward / entry_exit
            self._handles.append(m.register_forward_hook(self.opener_raised, always_call=True))

    # ------------------------------------------------------------------ entries
    def entry_enter(self, module: Any, args: Any, kwargs: Any):
        """A container or root holder called outside a forward opens one as the root's forward
        would (entries.py [Note: forwards entered below the root]). Inside a forward (the
        common case) one flag read: traced by torch.compile without a graph break."""
        if self.in_forward and self._opener is not None:
            return None
        return _eager(self._open_entry)(module, args, kwargs)

    def _open_entry(self, module: Any, args: Any, kwargs: Any):
        if self.in_forward and self._opener is not None or in_autograd_backward():
            return None  # a recompute: the root is live until the backward ends
        if id(module) in self._holders and (torch.is_grad_enabled() or self.units[0].live):
            return None
        return self.pre_forward(self.units[0], module, args, kwargs)

    def entry_exit(self, module: Any, args: Any, output: Any):
        if self._opener is not module or not self.in_forward:
            return None
        return _eager(self.post_forward)(self.units[0], module, args, output)

    def opener_raised(self, module: Any, args: Any, output: Any) -> None:
        """The opener's forward raised (its post-forward hook, which clears ``_opener``, did not
        run): the forward stays open (``in_forward``) for the next root or entry forward to
        reset (one rank) or refuse (several), as after a root forward that raised."""
        if self._opener is module:
            self._opener = None

    def syncing(self) -> bool:
        return self.sync_grads and not (self.ctx is not None and self.ctx.no_sync)

    def warn_no_decay_lost(self, param_groups: List[Any]) -> None:
        """An optimizer's groups made by name over these shards (splits.py [Note: an empty no-decay group])."""
        warn_no_decay_lost(self.units, param_groups)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, u: Any, module: Any, args: Any, kwargs: Any):
        if not self.in_forward and in_autograd_backward():
            return self.recompute_enter(u, args, kwargs)
        if u.is_root:
            if (self.in_forward or self.in_backward) and self.world > 1:
                # One rank cannot tell the others' collectives apart from here on.
                raise RuntimeError("offload.shard: the root module was called inside its own forward, or after a "
                                   "forward or backward that raised: with several ranks, start over")
            self._check_shards()
            refuse_ddp_above(self.units, self._ddp_passed)
            if self.in_backward:  # one rank: a backward that raised (a Ctrl-C) never reached final()
                self._drop_unfinished_backward()
            self.in_forward = self.in_backward = False  # one rank: an earlier forward that raised
            self._drop_stale()
            self.fwd_gen += 1
            self.schedule.begin("fwd")
            self.in_forward = True
            self._opener = module
        elif not self.in_forward:
            raise RuntimeError(f"offload.shard: unit {u.name!r} was called outside the forward of the module "
                               "passed to offload.shard(); call that module")
        self.schedule.acquire(u)
        return self._route(u, args, kwargs)

    def _route(self, u: Any, args: Any, kwargs: Any):
        """The inputs that require grad, through ``_PostBackward`` (a use whose backward is awaited)."""
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        routed = _PostBackward.apply(self, u, self.fwd_gen, *[flat[i] for i in idx])
        for i, t in zip(idx, routed):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, u: Any, module: Any, args: Any, output: Any):
        if self.recomputes.current(u):
            return None  # recompute_exit's
        outs = self._count_use(u, output)
        if not u.is_root:
            self.schedule.release(u)
            return None
        self.in_forward = False
        self._opener = None
        self.schedule.end(torch.zeros(self.schedule.nflags, dtype=torch.int64))
        if not outs:  # no backward will come
            self.schedule.release(u)
        return None

    def _count_use(self, u: Any, output: Any) -> List[torch.Tensor]:
        """A use whose backward is awaited: the pre-backward hook on ``output``'s tensors."""
        outs = _grad_tensors(output) if torch.is_grad_enabled() else []
        if outs:
            u.uses += 1
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda _g, u=u, gen=self.fwd_gen: self.pre_backward(u, gen), mode="any")
        return outs

    # ------------------------------------------------------------------ recompute
    def recompute_enter(self, u: Any, args: Any, kwargs: Any):
        """A unit's forward during a backward: recompute.py [Note: activation checkpointing]."""
        if not self.in_backward:  # a recompute before any pre-backward hook ran
            self._check_gen(self.fwd_gen)
            self._begin_backward()
        reentrant = reentrant_recompute()
        track = torch.is_grad_enabled() and (reentrant or u.uses == 0)
        if track and reentrant and u.index in self.reducer.ready_set and self.syncing():
            raise RuntimeError(f"offload.shard: unit {u.name or '<root>'!r} is recomputed by a reentrant activation "
                               "checkpoint (use_reentrant=True) after its grads of this backward were reduced: it is "
                               "called more than once in the forward, inside a reentrant checkpoint. Use "
                               "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), which counts every use")
        self.recomputes.enter(u, track)
        return self._route(u, args, kwargs) if track else None

    def recompute_exit(self, u: Any, module: Any, args: Any, output: Any) -> None:
        if self.recomputes.exit(u):
            self._count_use(u, output)

    def _check_shards(self) -> None:
        """The shards are still the params the views alias (a few attribute reads per unit): a
        shard rebound (``p.data = ...``), replaced, deleted or parametrized after ``shard()`` would
        be stepped by the optimizer while the forward reads the old buffer (guards.py [Note:
        calls on a sharded model] refuses the module calls that did it; this catches the rest)."""
        for u in self.units:
            for flat in u.flats:
                p = u.module._parameters.get(flat._attr)
                if p is not flat.shard or p.dtype != flat.dtype or p.data_ptr() != flat.shard_ptr:
                    where = flat.where
                    raise RuntimeError(f"offload.shard: the shard param {where!r} was replaced, rebound (.data =), "
                                       "deleted or parametrized after offload.shard(): the forward reads the "
                                       "buffer it was sharded into. Change the model (parametrizations, weight "
                                       "norm, casts) before offload.shard()")

    def _drop_stale(self) -> None:
        """A forward whose backward never ran: forget its uses, release what it held."""
        self.recomputes.reset()
        for u in self.units:
            u.uses = 0
            if u.live:
                self.schedule.release(u)

    def _drop_unfinished_backward(self) -> None:
        """A backward that raised part-way left grads in the units' views (the params autograd
        accumulates into, which ``zero_grad()`` cannot see: it clears the shards) and the
        param tier in its deferred-store mode. torch's ``zero_grad()`` after such a backward
        leaves no grad anywhere; the views' partial grads kept would be added to the next
        backward's. So they go here, as the next forward starts (one rank only: with several
        the forward refuses), and the tier's writes are waited for."""
        for u in self.units:
            u.drop_grads()
        if self.tier is not None:
            self.tier.defer_stores = False
            self.tier.flush()

    # ------------------------------------------------------------------ backward
    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.recomputes.reset()
        if self.tier is not None:
            self.tier.defer_stores = True  # grads leave while the next unit computes ([Note: async stores])
        self.schedule.begin("bwd")
        self.reducer.begin()
        torch.autograd.Variable._execution_engine.queue_callback(self.final)

    def _check_gen(self, gen: int) -> None:
        """[Note: one backward per forward]"""
        if gen != self.fwd_gen:
            raise RuntimeError("offload.shard: a backward through the graph of a forward that was followed by "
                               "another forward of the sharded model (also one under torch.no_grad()) before this "
                               "backward: its grads would be wrong. Run each forward's backward before the next "
                               "forward (sum the losses of one forward, or call backward once per forward)")
        if gen == self.bwd_done_gen:
            raise RuntimeError("offload.shard: a second backward through the same forward's graph "
                               "(retain_graph=True, or torch.autograd.grad(..., create_graph=True) and then a "
                               "backward: a gradient penalty) is not supported: its grads would not be reduced. "
                               "Run the forward again for each backward")

    def pre_backward(self, u: Any, gen: int) -> None:
        self._check_gen(gen)
        self._begin_backward()
        if self.recomputes.held:
            self.recomputes.drop(claim=u)
        self.schedule.acquire(u)
        self.reducer.pump()  # buckets queued behind a full window (grads.py [Note: reduce buckets])

    def post_backward(self, u: Any, gen: int) -> None:
        self._check_gen(gen)
        self._begin_backward()
        if u.uses == 0:
            return
        u.uses -= 1
        if u.uses == 0:
            self._unit_done(u)

    def _unit_done(self, u: Any) -> None:
        if u in self.recomputes.held:
            self.recomputes.held.remove(u)
        if not u.is_root and u.live:
            self.schedule.release(u)
        if self.syncing():  # once per backward (a use counted by a recompute may come after): ready() keeps a set
            self.reducer.ready(u)

    def final(self) -> None:
        try:
            self.recomputes.drop()
            for u in self.units[1:] + self.units[:1]:  # the root's backward ends last
                if u.uses:
                    u.uses = 0
                    self._unit_done(u)
            root = self.units[0]
            if root.live:
                self.schedule.release(root)
            sync = self.syncing()
            flags = self.reducer.local_flags() if sync else torch.zeros(self.schedule.nflags, dtype=torch.int64)
            anywhere, agreed = self.schedule.end(flags, order_hash(self.reducer.order) if sync else 0)
            if sync:
                self.reducer.finish(anywhere, agreed)
                self._check_late_grads()
            self.bwd_done_gen = self.fwd_gen
        finally:
            self.in_backward = False
            if self.tier is not None:
                self.tier.defer_stores = False
                self.tier.flush()  # the grads on disk before the step reads them ([Note: async stores])

    def _check_late_grads(self) -> None:
        """Every unit that was reduced holds no grads now (see recompute.py's note): grads that came
        after the reduction (a recompute's nested backward) would be lost or added to the next step's."""
        late = [u for u in self.units if u.index in self.reducer.ready_set and u.has_grads()]
        if not late:
            return
        for u in late:
            u.drop_grads()
        raise RuntimeError(f"offload.shard: units {[u.name or '<root>' for u in late]} got grads after they were "
                           "reduced in this backward (a unit recomputed by a reentrant activation checkpoint after "
                           "its other uses were done?): the grads are incomplete. Use "
                           "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")

    def place_grads(self, swap_dir: str, io: Any = "auto") -> None:
        """Grad shards into a swap file (the optimizer's states are on NVMe): the params' file
        when they are on NVMe, else a new one under ``swap_dir`` ([Note: grads on disk])."""
        if self.tier is None:
            from offload.shard.tier import ParamTier

            self.tier = ParamTier(swap_dir, self.rank, io=io)
        for u in self.units:
            for flat in u.flats:
                flat.place_grads(self.tier)

    # ------------------------------------------------------------------ reports
    def live_bytes(self) -> int:
        """Bytes of full (gathered) unit buffers allocated now on this rank."""
        return sum(u.live_bytes() for u in self.units)

    def remove(self) -> None:
        """The hooks go, and the reduce group when it is ours (every rank calls this: the model
        is no longer a sharded one after it)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        end, self._group_end = self._group_end, None
        if end is not None:
            end()
