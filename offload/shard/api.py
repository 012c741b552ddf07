"""``offload.shard(module)``: ZeRO stage 3 for a CPU model (FSDP2's ``fully_shard``, one call
for the whole model).

Every trainable param of ``module`` ends in one fetch unit (units.py); a unit's params of one
dtype become one flat buffer of ``world * chunk`` elements, of which this rank keeps its chunk
as an ``nn.Parameter`` named ``_shard_<dtype>`` on the unit module (flat_unit.py [Note: flat
unit layout]). ``module.parameters()`` then yields the shards (and the frozen params, whole),
which any offload optimizer steps as stage 3: each rank its own shard, grads already
averaged (offload/optim/shard_store.py). ``module.state_dict()`` holds this rank's shards
under those names (``blocks.0._shard_float32``): a per-rank checkpoint of the params, not
the full model's (``full_state_dict`` is future work).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from offload.config import parse_bytes
from offload.shard.flat_unit import FlatParam, ShardInfo, Unit
from offload.shard.hooks import ShardRuntime
from offload.shard.units import UnitPolicy, assign_params, choose_units
from offload.zero import comm

__all__ = ["shard", "runtime_of", "gathered_params", "OFFLOAD_PARAMS"]

OFFLOAD_PARAMS = ("none", "cpu", "nvme")
_RUNTIME = "_offload_shard_runtime"


def runtime_of(module: nn.Module) -> Optional[ShardRuntime]:
    """The ``ShardRuntime`` of a module ``shard`` changed (None for any other module)."""
    return module.__dict__.get(_RUNTIME)


def _check(module: Any, offload_params: Any, prefetch: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload.shard() expects an nn.Module, but got {type(module).__name__}")
    if offload_params not in OFFLOAD_PARAMS:
        raise ValueError(f"offload_params must be one of {OFFLOAD_PARAMS}, got {offload_params!r}")
    if offload_params == "nvme":
        raise NotImplementedError("offload_params='nvme' is not implemented yet; use 'none' or 'cpu'")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if runtime_of(module) is not None or any(hasattr(p, "_offload_shard") for p in module.parameters()):
        raise ValueError("this module is already sharded by offload.shard()")
    for name, p in module.named_parameters():
        if p.device.type != "cpu":
            raise NotImplementedError(f"offload.shard: param {name!r} is on {p.device}; only CPU params are "
                                      "supported yet (the CUDA path is future work)")
        if not p.is_floating_point():
            raise TypeError(f"offload.shard: param {name!r} has dtype {p.dtype}; expected a floating point dtype")


def _live_budget(max_live_params: Any, max_live_bytes: Any) -> Tuple[Optional[int], bool]:
    """(the live window's cap or None, whether in bytes): the planner's names
    (offload/plan/stage3.py); a byte count may be a string ("512MiB", offload.config)."""
    if max_live_params is not None and max_live_bytes is not None:
        raise ValueError("give max_live_params or max_live_bytes, not both")
    if max_live_params is not None:
        if isinstance(max_live_params, bool) or not isinstance(max_live_params, int) or max_live_params < 1:
            raise ValueError(f"max_live_params must be an int >= 1, got {max_live_params!r}")
        return max_live_params, False
    if max_live_bytes is None:
        return None, True
    if isinstance(max_live_bytes, str):
        max_live_bytes = parse_bytes(max_live_bytes)
    if isinstance(max_live_bytes, bool) or not isinstance(max_live_bytes, int) or max_live_bytes < 1:
        raise ValueError(f"max_live_bytes must be a byte count >= 1 (an int or a string such as '512MiB'), "
                         f"got {max_live_bytes!r}")
    return max_live_bytes, True


def _reduce_group(group: Any, world: int) -> Any:
    """A second group of the same ranks: the reduce-scatters' own (grads.py [Note: reduce order])."""
    if world == 1:
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks)


def shard(module: nn.Module, *, process_group: Any = None, offload_params: str = "none",
          unit: UnitPolicy = None, prefetch: int = 1, max_live_params: Optional[int] = None,
          max_live_bytes: Any = None) -> nn.Module:
    """Shard ``module``'s trainable params over the ranks of ``process_group`` (ZeRO stage 3),
    in place; returns ``module``.

    ``unit``: which modules are fetch units (units.py: None = the elements of every
    ``nn.ModuleList``, a set of module classes, or an int: params per unit at least). The
    rest, and params tied across units, form the root unit, gathered for the whole forward
    and backward. ``prefetch``: how many units' gathers run ahead of the one in use, once
    the order is known (schedule.py). ``max_live_params`` / ``max_live_bytes`` (one of them;
    bytes as an int or "512MiB"): prefetch never takes the gathered units (the root
    included) over it; the unit in use is gathered even when it alone is over (a warning,
    once). ``offload_params``: "none" and "cpu" (the same on a
    CPU model: the shards live in host memory); "nvme" is not implemented yet. Every rank
    must build the same model (same init) before calling this. A collective when
    ``torch.distributed`` is initialised: it makes a process group for the grads'
    reduce-scatters (``dist.new_group``, which every process of the default group must
    call, also those outside ``process_group``)."""
    _check(module, offload_params, prefetch)
    budget, in_bytes = _live_budget(max_live_params, max_live_bytes)
    world, rank = comm.world_and_rank(process_group)
    reduce_group = _reduce_group(process_group, world)
    unit_modules = choose_units(module, unit)
    members, _frozen = assign_params(module, unit_modules)
    names: Dict[int, str] = {id(m): n for n, m in module.named_modules()}
    qual: Dict[int, str] = {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    units: List[Unit] = []
    for m, ps in zip(unit_modules, members):
        if m is not module and not ps:
            continue
        name = names.get(id(m), "")
        by_dtype: Dict[torch.dtype, list] = {}
        for p, owners in ps:
            by_dtype.setdefault(p.dtype, []).append((p, owners))
        flats = [FlatParam(ms, info=ShardInfo(process_group, world, rank, name), holder=m,
                           attr=f"_shard_{str(dt).replace('torch.', '')}",
                           names=[qual[id(p)] for p, _ in ms])
                 for dt, ms in by_dtype.items()]
        units.append(Unit(len(units), m, name, flats))
    runtime = ShardRuntime(units, group=process_group, reduce_group=reduce_group, world=world, rank=rank,
                           prefetch=prefetch, budget=budget, budget_in_bytes=in_bytes)
    runtime.install()
    for u in units:
        for flat in u.flats:
            flat.shard._offload_shard.runtime = runtime
    module.__dict__[_RUNTIME] = runtime
    return module


@torch.no_grad()
def gathered_params(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Every sharded param, whole, by its name before ``shard()`` (a tied param under its
    first name): new tensors. A collective: every rank of the group calls it (between
    steps). The first piece of a ``full_state_dict``."""
    runtime = runtime_of(module)
    if runtime is None:
        raise ValueError("gathered_params() needs a module changed by offload.shard()")
    out: Dict[str, torch.Tensor] = {}
    for u in runtime.units:
        for flat in u.flats:
            full = torch.empty(flat.padded, dtype=flat.dtype)
            comm.all_gather(full, flat.shard.detach(), flat.shard._offload_shard.group)
            for name, shape, (o, n) in zip(flat.names, flat.shapes, flat.slots):
                out[name] = full[o:o + n].view(shape).clone()
    return out
