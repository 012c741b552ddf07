"""Stage 3: the optimizer over the shards of ``offload.shard`` (offload/shard/).

[Note: stage 3 store] Each rank's params are its own shards (``p._offload_shard``), their
grads already reduce-scattered and averaged over the ranks by the shard hooks. So the store
is an unpartitioned one (stage 0: the host store for fp32 CPU shards, the flat store for
bf16 / fp16 ones, the swapped store for fp32 with ``offload="nvme"``) on each rank's own
shards, wrapped to make the step's facts global: the grad norm for ``max_grad_norm`` is the
all-reduced sum of squares of every rank's shard grads (as the stage-2 path's), and
GradScaler's ``found_inf`` is agreed (max over ranks) so that every rank skips or none.

[Note: a param without a grad] A unit's params of one dtype are one shard, stepped as one
tensor with one step count. A param that got no grad on any rank while others of its shard
did (a branch not taken, an expert no token was routed to, a layer never called) is stepped
with a zero grad: weight decay and its moments still move it, where torch.optim skips a param
whose ``.grad`` is None (and an unused param's moments, fed zeros, do not restart either).
Exact per-param skipping would need per-param step counts inside a shard; what is done instead
is to say so: the backward's final round (offload/shard/schedule.py) agrees, per param, whether
any rank had a grad for it (flags the round carries anyway, no collective of its own), and the
step warns once per param that had none while its shard was stepped.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, List, Optional, Tuple

import torch

from offload.optim.host_state import HostState
from offload.optim.scaler_sync import as_flag
from offload.zero import comm

__all__ = ["shard_group", "stage3_store", "Stage3Store"]


def shard_group(params: List[torch.Tensor]) -> Tuple[bool, Any]:
    """(whether ``params`` come from offload.shard, its process group); ValueError when only
    some trainable ones do, or they come from differently sharded models."""
    infos = [getattr(p, "_offload_shard", None) for p in params]
    if all(i is None for i in infos):
        return False, None
    loose = [i for i, (p, info) in enumerate(zip(params, infos)) if info is None and p.requires_grad]
    if loose:
        raise ValueError(f"params {loose[:5]} are not shards of offload.shard() while others are: a stage 3 "
                         "optimizer needs every trainable param sharded (shard the whole model)")
    groups = {id(i.group) for i in infos if i is not None}
    if len(groups) != 1:
        raise ValueError("params come from offload.shard() calls with different process groups")
    return True, next(i for i in infos if i is not None).group


def stage3_store(opt: Any, stage: Optional[int], process_group: Any):
    """The store for shard params (see the note), or None for any other params (a ValueError
    for them with stage=3)."""
    if getattr(opt, "_in_stage3", False):
        return None
    params = opt._all_params()
    sharded, group = shard_group(params)
    if not sharded:
        if stage == 3:
            raise ValueError("Invalid stage: 3 for these params: stage 3 partitions the params themselves; shard "
                             "the model with offload.shard(model) and build the optimizer over model.parameters()")
        return None
    if stage not in (None, 0, 3):
        raise ValueError(f"stage={stage} with params of offload.shard(): they are partitioned already (stage 3); "
                         "drop stage= (or pass 3)")
    if process_group is not None and process_group is not group:
        raise ValueError("process_group= differs from the one the params were sharded over")
    if getattr(opt, "master_dtype", None) == "bfloat16" and any(
            getattr(getattr(getattr(p, "_offload_shard", None), "runtime", None), "params_on_disk", False)
            for p in params):
        raise ValueError("master_dtype='bfloat16' with offload.shard(offload_params='nvme'): the params would be the "
                         "only copy of the master, in a file that is not crash-safe; keep the fp32 master "
                         "(master_dtype=None)")
    runtimes = {id(i.runtime): i.runtime for i in (getattr(p, "_offload_shard", None) for p in params)
                if i is not None and getattr(i, "runtime", None) is not None}.values()
    _check_grads_placed(runtimes, opt.config.offload)
    for runtime in runtimes:
        runtime.warn_no_decay_lost(opt.param_groups)
    opt._in_stage3 = True
    try:
        inner = opt._make_store(0, None)
    finally:
        opt._in_stage3 = False
    if opt.config.resume is True and comm.world_and_rank(group)[0] > 1:
        _check_resumed_steps(inner, group, opt.config.swap_dir)
    opt.stage = 3
    # the grad shards live where the states do; a store that swaps nothing (SGD without
    # momentum: the host store, which steps with p.grad in place) keeps them in RAM: placed on
    # disk, p.grad was the zero stand-in and no param ever moved, silently (forty-eighth session)
    on_disk = opt.config.offload == "nvme" and not isinstance(inner, HostState)
    if opt.config.offload == "nvme" and not on_disk:
        try:
            _check_grads_placed(runtimes, "cpu")
        except ValueError:
            inner.close()
            raise
    for rt in runtimes:
        rt.ctx = opt._ctx  # the shard hooks follow opt.no_sync()
        if on_disk:
            rt.place_grads(opt.config.swap_dir, opt.config.io)
    opt._stage_auto_single = False
    opt._process_group = group
    return Stage3Store(inner, group, opt._ctx, backend=opt.backend, num_threads=opt.num_threads)


def _check_grads_placed(runtimes: Any, offload: str) -> None:
    """An earlier optimizer with offload="nvme" sent the model's grad shards to swap files
    (``p.grad`` a one-element stand-in); one that keeps its states elsewhere would step on the
    stand-ins: refused, until the grads can be placed back (a model sharded anew)."""
    if offload == "nvme":
        return
    if any(flat.grad_area is not None for rt in runtimes for u in rt.units for flat in u.flats):
        raise ValueError(f"offload={offload!r} on a model whose grad shards an earlier optimizer with "
                         "offload='nvme' placed in swap files (they stay there): build this optimizer with "
                         "offload='nvme' too, or shard a new model")


def _check_resumed_steps(inner: Any, group: Any, swap_dir: Any) -> None:
    """The ranks' resumed swap files must hold one step (each rank's store is its own here:
    nothing else compares them), a rank one step ahead going back to the others' ([Note: a
    rank one step ahead] in swap/agreement.py); else every rank raises, the directories kept."""
    from offload.optim.flat.swapped import agree_on_resumed_step, params_from_swap, resume_steps

    flat = hasattr(inner, "_swap")  # the flat store's SwappedShards; SwappedState's is its core
    swap = inner._swap if flat else getattr(inner, "core", None)

    def reset() -> None:  # what the inner store read from the step it went back from
        if flat:
            resume_steps(inner)
            params_from_swap(inner)  # this rank's shards only (the inner store is one rank's)
        else:
            inner.resume_counts()

    try:
        agree_on_resumed_step(swap, group, swap_dir, reset)
    except BaseException:
        inner.close(keep_swap=True) if swap is not None else inner.close()
        raise


def _device_sumsq(work, backend: Optional[str], threads: Optional[int]) -> Tuple[float, bool]:
    """The sum of squares of grads some of which are on a device (offload.shard of a CUDA
    model, offload_params="none"): those taken there in float64 (as the flat store's [Note:
    device grad norm]), the host ones by the kernel."""
    from offload.optim.clip import _sumsq

    host = [(k, [(p, g) for p, g in items if g.device.type == "cpu"]) for k, items in work]
    s, bad = _sumsq(host, backend, threads)
    on_device = [g for _, items in work for _, g in items if g.device.type != "cpu" and g.numel()]
    if on_device:
        d = float(sum(torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square().cpu() for g in on_device))
        s, bad = s + d, bad or not math.isfinite(d)
    return s, bad


class Stage3Store:
    """An unpartitioned store on this rank's shards, with the step's facts made global."""

    def __init__(self, inner: Any, group: Any, ctx: Any, *, backend: Optional[str], num_threads: Optional[int]):
        self._inner, self.group, self._ctx = inner, group, ctx
        self._backend, self._threads = backend, num_threads
        self.world = comm.world_and_rank(group)[0]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def kind(self) -> str:
        return self._inner.kind

    def begin_step(self) -> None:
        begin = getattr(self._inner, "begin_step", None)
        if begin is not None:
            begin()
        found_inf = as_flag(self._ctx.found_inf)  # (the int 0 on a rank without grads: scaler_sync.py)
        if self.world > 1 and found_inf is not None:
            flag = found_inf.detach().to(comm.comm_device(self.group), torch.float32).reshape(1).clone()
            comm.all_reduce(flag, self.group, op=torch.distributed.ReduceOp.MAX)
            self._ctx.found_inf = flag.to(found_inf.device).reshape(found_inf.shape)

    def global_grad_sumsq(self, work) -> Tuple[float, bool]:
        from offload.optim.clip import _sumsq

        # this rank's shard grads only (the inner store's own norm may read grads the way it
        # keeps them, not the paged ones of params on NVMe): one pass each, paged in pieces
        if any(g.device.type != "cpu" for _, items in work for _, g in items):
            s, bad = _device_sumsq(work, self._backend, self._threads)  # shards on a device
        else:
            s, bad = _sumsq(work, self._backend, self._threads)
        acc = torch.tensor([s, float(bad)], dtype=torch.float64, device=comm.comm_device(self.group))
        comm.all_reduce(acc, self.group)
        s, bad = acc.tolist()
        return s, bad > 0

    def grads(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The inner store's answer, except for a grad kept in a swap file (params on NVMe):
        the paged grad itself, not p.grad's stand-in ([Note: grads on disk] in
        offload/shard/flat_unit.py)."""
        inner = getattr(self._inner, "grads", None)
        g = inner(p) if inner is not None else p.grad
        info = getattr(p, "_offload_shard", None)
        flat = getattr(info, "flat", None)
        if g is not None and flat is not None:
            disk = flat.disk_grad()
            if disk is not None:
                return disk
        return g

    def step(self, batches):
        _warn_params_without_grads(p for _, items in batches for p, _, _ in items)
        return self._inner.step(batches)

    def export_state(self, p):
        return self._inner.export_state(p)

    def import_state(self, p, state):
        return self._inner.import_state(p, state)

    def reset_state(self, p):
        return self._inner.reset_state(p)

    def save_checkpoint(self, *args, **kwargs):
        self._one_rank_only("save_checkpoint")
        return self._inner.save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        self._one_rank_only("load_checkpoint")
        return self._inner.load_checkpoint(*args, **kwargs)

    def _one_rank_only(self, what: str) -> None:
        """[Note: the optimizer's own checkpoint at stage 3] The inner store is a one-process
        store over this rank's shards: its checkpoint is the files of a rank 0 (``DIR/rank0``).
        On several ranks every rank wrote that one directory (a CheckpointBusy when two saves
        met, else the last rank's shards kept as everyone's) and every rank loaded rank 0's
        shard states into its own, same-shaped shards, silently (forty-eighth session's
        2-rank history fuzz). The world size is the same fact on every rank: all refuse,
        before any file is touched."""
        if self.world > 1:
            raise ValueError(f"opt.{what}() at stage 3 on {self.world} ranks: its files hold one rank's shards "
                             f"(every rank would use the same DIR/rank0); use offload.shard.{what}(model, opt, DIR), "
                             "which keeps a file per rank and reshards N -> M (a collective: every rank calls it)")

    def memory_report(self):
        return self._inner.memory_report()

    def close(self, keep_swap: bool = False):
        return self._inner.close(keep_swap=keep_swap) if keep_swap else self._inner.close()


def _warn_params_without_grads(shards) -> None:
    """[Note: a param without a grad]: once per param; the flags start afresh for the next step."""
    for p in shards:
        flat = getattr(getattr(p, "_offload_shard", None), "flat", None)
        if flat is None:
            continue
        anywhere, flat.grads_anywhere = flat.grads_anywhere, None
        flat.grads_taken = [False] * len(flat.leaves)
        for name, had in zip(flat.names, anywhere or ()):
            if not had and name not in flat.warned_no_grad:
                flat.warned_no_grad.add(name)
                warnings.warn(f"offload.shard: {name!r} got no grad on any rank in this step, but other params "
                              f"of its shard ({flat.where!r}) did: stage 3 steps a shard's params as one tensor, "
                              "so it is stepped with a zero grad (weight decay and its moments still change it), "
                              "where torch.optim skips a param whose .grad is None. If it is never used, freeze "
                              "it (requires_grad_(False)) before offload.shard(); if it is used on some steps "
                              "only, make its module a unit of its own (offload.shard(..., unit=...)). Said once "
                              "per param", RuntimeWarning, stacklevel=2)
