"""``offload.shard(module)``: ZeRO stage 3 for a CPU or CUDA model (FSDP2's ``fully_shard``, one call
for the whole model).

Every trainable param of ``module`` ends in one fetch unit (units.py); a unit's params of one
dtype become one flat buffer of ``world * chunk`` elements, of which this rank keeps its chunk
as an ``nn.Parameter`` named ``_shard_<dtype>`` on the unit module (flat_unit.py [Note: flat
unit layout]). ``module.parameters()`` then yields the shards (and the frozen params, whole),
which any offload optimizer steps as stage 3: each rank its own shard, grads already
averaged (offload/optim/shard_store.py). ``module.state_dict()`` holds this rank's shards
under those names (``blocks.0._shard_float32``): a per-rank checkpoint of the params, not
the full model's: ``offload.shard.full_state_dict`` (fullstate.py) gathers that.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from offload.config import parse_bytes
from offload.memory import paging
from offload.shard import device as device_mod
from offload.shard import guards
from offload.shard.flat_unit import FlatParam, ShardInfo, Unit
from offload.shard.hooks import ShardRuntime
from offload.shard.materialize import check_inits, has_meta, materialize
from offload.shard.splits import check_split, flat_groups
from offload.shard.tier import ParamTier
from offload.shard.units import UnitPolicy, assign_params, choose_units
from offload.shard.weights import attach, load_weights, record_keys
from offload.zero import comm

__all__ = ["shard", "runtime_of", "gathered_params", "OFFLOAD_PARAMS"]

OFFLOAD_PARAMS = ("none", "cpu", "nvme")
_RUNTIME = "_offload_shard_runtime"


def runtime_of(module: nn.Module) -> Optional[ShardRuntime]:
    """The ``ShardRuntime`` of a module ``shard`` changed (None for any other module)."""
    return module.__dict__.get(_RUNTIME)


def _check(module: Any, offload_params: Any, prefetch: Any, swap_dir: Any = None, split: Any = None) -> None:
    check_split(split)
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload.shard() expects an nn.Module, but got {type(module).__name__}")
    if offload_params not in OFFLOAD_PARAMS:
        raise ValueError(f"offload_params must be one of {OFFLOAD_PARAMS}, got {offload_params!r}")
    if offload_params == "nvme" and not swap_dir:  # "" too (an unset variable): abspath would make it the cwd
        raise ValueError("offload_params='nvme' needs swap_dir= (a directory on a local disk)")
    if offload_params != "nvme" and swap_dir is not None:
        raise ValueError(f"swap_dir= is for offload_params='nvme' (got offload_params={offload_params!r})")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if runtime_of(module) is not None or any(hasattr(p, "_offload_shard") for p in module.parameters()):
        raise ValueError("this module is already sharded by offload.shard()")
    devices = set()
    for name, p in module.named_parameters():
        if p.device.type not in ("cpu", "meta", "cuda"):
            raise NotImplementedError(f"offload.shard: param {name!r} is on {p.device}; only CPU and CUDA params are "
                                      "supported")
        if p.device.type != "meta":
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"offload.shard: params on several devices ({sorted(map(str, devices))}); move the "
                             "model to one device first")
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
    """A second group of the same ranks: the reduce-scatters' own (grads.py [Note: reduce order]),
    made when ``world > 1`` for one model, destroyed with it (hooks.py [Note: the reduce group's end])."""
    if world == 1:
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks)


def shard(module: nn.Module, *, process_group: Any = None, offload_params: str = "none",
          unit: UnitPolicy = None, prefetch: int = 1, swap_dir: Optional[str] = None, io: Any = "auto",
          init_fn: Optional[Callable[[nn.Module], Any]] = None, weights: Any = None,
          max_live_params: Optional[int] = None, max_live_bytes: Any = None, split: Any = None) -> nn.Module:
    """Shard ``module``'s trainable params over the ranks of ``process_group`` (ZeRO stage 3),
    in place; returns ``module``.

    ``unit``: which modules are fetch units (units.py: None = the elements of every
    ``nn.ModuleList``, a set of module classes, or an int: params per unit at least). The
    rest, and params tied across units, form the root unit, gathered for the whole forward
    and backward; ``split``: flats (param groups) by key (splits.py [Note: split flats]).
    ``prefetch``: how many units' gathers run ahead of the one in use, once the order is
    known (schedule.py). ``max_live_params`` / ``max_live_bytes`` (one of them; bytes as an
    int or "512MiB"): prefetch never takes the gathered units (the root
    included) over it; the unit in use is gathered even when it alone is over (a warning,
    once). ``offload_params``: "none" and "cpu" (a CPU model's shards live in host memory; on
    CUDA "none": on the device, "cpu": pinned, device.py [Note: stage 3 on a device]); "nvme":
    each rank's shards live in a file under ``swap_dir`` and come into RAM only while gathered or stepped ([Note: the param
    tier] in tier.py; ``io``: the io engine, as the optimizers'); the grad shards live where
    the optimizer keeps its states (a swap file with ``offload="nvme"``). Every rank must build the same model (same init) before calling this. A collective when
    ``torch.distributed`` is initialised: it makes a process group for the grads'
    reduce-scatters (``dist.new_group``, which every process of the default group must
    call, also those outside ``process_group``).

    A model built under ``torch.device("meta")`` (all or some of its params and buffers) is
    materialized unit by unit, never whole (materialize.py [Note: meta materialization]):
    each module by ``init_fn(module)`` when given, else its ``reset_parameters()``; seed every
    rank the same. ``weights``: a torch or safetensors checkpoint path loaded right after,
    unit by unit, each rank its own slices (``load_weights``, strict); with it, only the
    non-persistent buffers of a meta model are initialised (the checkpoint has the rest)."""
    _check(module, offload_params, prefetch, swap_dir, split)
    budget, in_bytes = _live_budget(max_live_params, max_live_bytes)
    meta = has_meta(module)
    if init_fn is not None and not meta:
        raise ValueError("init_fn= initialises tensors on the meta device, and this model has none")
    if meta:
        check_inits(module, init_fn, weights)
    if weights is not None:
        weights = os.fspath(weights)
        if not os.path.isfile(weights):  # before the work, not after it
            raise FileNotFoundError(f"offload.shard: no checkpoint at weights={weights!r}")
    world, rank = comm.world_and_rank(process_group)
    streams = _device_streams(module)  # None: the CPU path; else [Note: stage 3 on a device]
    tier = ParamTier(os.path.expanduser(os.fsdecode(swap_dir)), rank, io=io) if offload_params == "nvme" else None
    reduce_group = _reduce_group(process_group, world)
    unit_modules = choose_units(module, unit)
    members, _frozen = assign_params(module, unit_modules)
    kept = [i for i, (m, ps) in enumerate(zip(unit_modules, members)) if m is module or ps]
    unit_modules, members = [unit_modules[i] for i in kept], [members[i] for i in kept]
    keys = record_keys(module, members)
    names: Dict[int, str] = {id(m): n for n, m in module.named_modules()}
    qual: Dict[int, str] = {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    plans = [flat_groups(ms, qual, split) for ms in members]  # names by position: materializing changes ids
    flats: Dict[int, List[FlatParam]] = {}

    def build(i: int) -> None:
        m, ms = unit_modules[i], members[i]
        flats[i] = [FlatParam([ms[j] for j in idx], info=ShardInfo(process_group, world, rank, names.get(id(m), "")),
                              holder=m, attr=attr, names=nm, tier=tier, streams=streams,
                              host_shard=offload_params != "none") for _dt, attr, idx, nm in plans[i]]

    if meta:
        materialize(module, unit_modules, members, build, init_fn, loading=weights is not None)
    else:
        for i in range(len(unit_modules)):
            build(i)
    del members
    units = [Unit(i, m, names.get(id(m), ""), flats[i]) for i, m in enumerate(unit_modules)]
    runtime = ShardRuntime(units, group=process_group, reduce_group=reduce_group, world=world, rank=rank,
                           prefetch=prefetch, budget=budget, budget_in_bytes=in_bytes, own_reduce=world > 1)
    runtime.tier, runtime.params_on_disk = tier, tier is not None
    runtime.install()
    for flat in (f for u in units for f in u.flats):
        flat.shard._offload_shard.runtime = runtime
    module.__dict__[_RUNTIME] = runtime
    attach(module, runtime, keys)
    guards.install(module, runtime)  # torch's calls that would break the layout: [Note: calls on a sharded model]
    if weights is not None:
        load_weights(module, weights)
    return module


def _device_streams(module: nn.Module) -> Any:
    """The side streams of the device the params are on (device.py), None for the CPU path."""
    p = next((p for p in module.parameters() if p.device.type != "meta"), None)
    if p is None:
        return None
    return device_mod.streams_for(p.device)


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
            group = flat.shard._offload_shard.group
            dev = comm.comm_device(group) if flat.world > 1 else flat.shard.device  # NCCL: device tensors
            full = torch.empty(flat.padded, dtype=flat.dtype, device=dev)
            src = flat.shard.detach()
            paging.load([src])  # params on NVMe: from the swap file
            comm.all_gather(full, src.to(dev), group)
            paging.evict([src])
            for name, shape, (o, n) in zip(flat.names, flat.shapes, flat.slots):
                out[name] = full[o:o + n].view(shape).to("cpu", copy=True)
    return out
