"""The few collectives the partitioned optimizer needs, on ``torch.distributed`` only.

Wrappers that (1) pick the current name of each collective (torch 2.13 renamed
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to ``*_single`` and warns on the old
names), (2) fall back where a backend lacks one, and (3) do nothing for a world of one, so
the optimizer runs the same code with and without ``torch.distributed``.

[Note: gloo reduce-scatter] Older gloo builds raise on ``reduce_scatter``; torch 2.13's gloo
has it for fp32, bf16 and fp16. When a backend refuses it we fall
back, once and for the rest of the process, to ``all_reduce`` of the whole bucket followed
by taking this rank's slice: the same result, twice the bytes on the wire.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from offload.swap import agreement
from offload.swap.agreement import all_or_none

__all__ = ["world_and_rank", "failed_ranks", "agree_on_params", "on_every_rank", "all_or_none", "reduce_scatter", "all_reduce", "all_gather", "broadcast", "reduce_async",
           "comm_device", "reduce_scatter_supported", "reduce_scatter_async", "all_reduce_async"]

log = logging.getLogger("offload.zero")

T = TypeVar("T")

_RS = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_AG = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_no_reduce_scatter: set = set()  # backend names that refused reduce_scatter (see the note)


def world_and_rank(group: Any = None) -> Tuple[int, int]:
    """(world size, rank) of ``group``, (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def comm_device(group: Any = None) -> torch.device:
    """Where tensors handed to collectives of ``group`` must live (NCCL: the current GPU)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend_name(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def reduce_scatter_supported(group: Any = None) -> bool:
    return _backend_name(group) not in _no_reduce_scatter


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """``out`` = this rank's 1/N slice of the elementwise sum of ``inp`` over ranks.

    ``inp`` has N * out.numel() elements and may be overwritten (the fallback sums into it).
    """
    world, rank = world_and_rank(group)
    n = out.numel()
    if inp.numel() != world * n:
        raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected {world} x {n}")
    if world == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    name = _backend_name(group)
    if name not in _no_reduce_scatter:
        try:
            _RS(out, inp, group=group)
            return
        except (RuntimeError, NotImplementedError) as exc:
            if "support" not in str(exc).lower():
                raise
            _no_reduce_scatter.add(name)
            log.warning("backend %s has no reduce_scatter (%s); using all_reduce + slice", name, exc)
    dist.all_reduce(inp, group=group)
    out.copy_(inp[rank * n:(rank + 1) * n])


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, group: Any = None):
    """``reduce_scatter`` started asynchronously; returns a handle with ``wait()``.

    Where the backend has no reduce_scatter (see the note) the fallback runs synchronously.
    """
    world, rank = world_and_rank(group)
    if world == 1 or _backend_name(group) in _no_reduce_scatter:
        reduce_scatter(out, inp, group)
        return _Done()
    try:
        return _RS(out, inp, group=group, async_op=True)
    except (RuntimeError, NotImplementedError) as exc:
        if "support" not in str(exc).lower():
            raise
        reduce_scatter(out, inp, group)  # records the missing feature, then falls back
        return _Done()


def all_reduce_async(t: torch.Tensor, group: Any = None):
    """In-place sum all-reduce started asynchronously; returns a handle with ``wait()``."""
    if world_and_rank(group)[0] == 1:
        return _Done()
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce(t: torch.Tensor, group: Any = None, op: Optional[Any] = None) -> None:
    """In-place all-reduce (sum by default); nothing for a world of one."""
    if world_and_rank(group)[0] == 1:
        return
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)


def failed_ranks(ok: bool, group: Any = None) -> List[int]:
    """Every rank says whether its part succeeded; the ranks of ``group`` that did not, on
    every rank. A collective: each rank must call it, in the same order as its others."""
    world, rank = world_and_rank(group)
    if world == 1:
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=comm_device(group))
    flags[rank] = 0 if ok else 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def agree_on_step(step: Optional[int], previous: Optional[int], what: str, group: Any = None) -> Optional[int]:
    """Every rank gives the step its swap files resumed at (None: it holds none) and the step
    their free slots still hold (``SwapStore.previous_step``); returns the step every rank
    resumes at: the common one, or, after a job killed between two ranks' commits, the step
    before when each rank a step ahead still holds it, which that rank must then go back to
    ([Note: a rank one step ahead] in offload/swap/agreement.py). Else a ValueError on every
    rank: resuming would mix steps (and hang later on a collective one rank takes and the
    other does not). A collective."""
    world, rank = world_and_rank(group)
    if world == 1:
        return step
    facts = torch.full((2 * world,), -1, dtype=torch.int64, device=comm_device(group))
    facts[2 * rank] = -1 if step is None else int(step)
    facts[2 * rank + 1] = -1 if previous is None else int(previous)
    dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=group)  # each rank wrote only its own slots (-1 elsewhere)
    got = facts.tolist()
    known = {r: s for r, s in enumerate(got[0::2]) if s >= 0}
    if len(set(known.values())) <= 1:
        return step
    low = min(known.values())
    if all(s == low or (s == low + 1 and got[2 * r + 1] == low) for r, s in known.items()):
        return None if step is None else low
    held = ", ".join(f"rank {r}: step {s}" for r, s in known.items())
    raise ValueError(f"{what}: the ranks' swap files hold different steps ({held}): "
                     "the job died between two ranks' commits, and no rank ahead still holds the step of the others "
                     "to go back to, so they cannot resume together; restart from a checkpoint (resume='discard', "
                     "then load_checkpoint) - the swap directories are left as they are")


def agree_on_params(param_groups: Sequence[Sequence[torch.Tensor]], stage: int, group: Any = None) -> None:
    """[Note: the same params on every rank] Partitioning (stages 1-2) lays every rank's
    params out alike and gives each rank a shard of the whole: each rank must pass the same
    params (shapes, dtypes, devices), in the same groups and order. A rank that passed others
    (a model built differently per rank; torch's ZeroRedundancyOptimizer, which gives each
    rank a part of the params and builds the optimizer over it) made the collectives of the
    first step mismatch: a hang, or shards reduced into the wrong elements. Checked when the
    store is built, a collective: a ValueError on every rank, naming what each passed. Only
    shapes, dtypes, devices and order are compared, not values: other params of the same
    shapes pass (torch's ZeroRedundancyOptimizer and DeepSpeed's CPU optimizer classes, which
    give each rank its own params, take stage 0 by default: [Note: inside
    ZeroRedundancyOptimizer] in wrapped.py)."""
    world, rank = world_and_rank(group)
    if world == 1:
        return
    shapes = [[(tuple(p.shape), str(p.dtype), p.device.type) for p in params] for params in param_groups]
    digest = hashlib.sha256(repr(shapes).encode()).digest()
    row = [(int.from_bytes(digest[:8], "little") >> 1) or 1, len(shapes), sum(map(len, shapes)),
           sum(p.numel() for params in param_groups for p in params)]
    facts = torch.zeros((world, len(row)), dtype=torch.int64, device=comm_device(group))
    facts[rank] = torch.tensor(row, dtype=torch.int64)
    all_reduce(facts, group)  # (a sum: each rank wrote only its own row)
    rows = facts.tolist()
    # Every rank's row holds a digest, never zero: rows still all zero are ranks that did not
    # answer, a group whose collectives do nothing (torch's "fake" backend, a test's
    # emulated ranks), where there is nothing to compare.
    if all(r == rows[0] for r in rows) or all(not any(r) for i, r in enumerate(rows) if i != rank):
        return
    each = "; ".join(f"rank {r}: {g} group(s), {n} params, {e:,} elements" for r, (_, g, n, e) in enumerate(rows))
    raise ValueError(f"offload optimizer (stage {stage}, {world} ranks): the ranks passed different params ({each}"
                     f"{'' if len({tuple(r[1:]) for r in rows}) > 1 else ', of other shapes, dtypes or devices'}). "
                     "Stages 1-2 give each rank a shard of the same params: build the optimizer over the same params, "
                     "in the same groups and order, on every rank; to step each rank's own params (torch's "
                     "ZeroRedundancyOptimizer builds the optimizer over a part of them per rank), pass stage=0")


def on_every_rank(fn: Callable[[], T], what: str, group: Any = None, world: Optional[int] = None) -> T:
    """Run ``fn`` on this rank, then agree with the others of ``group`` (a collective, and a
    barrier; see :func:`offload.swap.agreement.on_every_rank`). ``world``: the caller's own
    world size when it differs from the group's (an unpartitioned optimizer in a distributed
    job); 1 just runs ``fn``."""
    if world == 1:
        return fn()
    return agreement.on_every_rank(fn, what, functools.partial(failed_ranks, group=group))


# all_or_none (imported above): the swap layer's prepare / vote / commit / undo state machine,
# offload.swap.agreement, re-exported for the callers of this module.


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """``out`` = concatenation over ranks of ``inp`` (N * inp.numel() elements)."""
    world, _ = world_and_rank(group)
    if out.numel() != world * inp.numel():
        raise ValueError(f"all_gather: output has {out.numel()} elements, expected {world} x {inp.numel()}")
    if world == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    _AG(out, inp, group=group)


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any = None):
    """``all_gather`` started asynchronously; returns a handle with ``wait()``."""
    world, _ = world_and_rank(group)
    if out.numel() != world * inp.numel():
        raise ValueError(f"all_gather: output has {out.numel()} elements, expected {world} x {inp.numel()}")
    if world == 1:
        all_gather(out, inp, group)
        return _Done()
    return _AG(out, inp, group=group, async_op=True)


def broadcast(t: torch.Tensor, src_group_rank: int, group: Any = None) -> None:
    """Broadcast ``t`` from the rank ``src_group_rank`` *of group* to all its ranks."""
    if world_and_rank(group)[0] == 1:
        return
    src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    dist.broadcast(t, src=src, group=group)


def reduce_async(t: torch.Tensor, dst_group_rank: int, group: Any = None):
    """In-place sum of ``t`` over the ranks into rank ``dst_group_rank`` *of group* (the others'
    ``t`` is left undefined), started asynchronously; returns a handle with ``wait()``."""
    if world_and_rank(group)[0] == 1:
        return _Done()
    dst = dst_group_rank if group is None else dist.get_global_rank(group, dst_group_rank)
    return dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
