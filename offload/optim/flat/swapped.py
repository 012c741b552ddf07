"""The flat store's nvme backing: opening / resuming the swap files, the params rebuilt from
them, and the state backing of the step loop over them (``SwapBacking``).

[Note: nvme] With offload="nvme" this rank's shards of the fp32 master, exp_avg and
exp_avg_sq all live in swap files (SwappedShards in swapped_shards.py: the groups'
shards end to end, streamed read g+1 / compute g / write g-1). Host memory keeps the
pipeline buffers, the grads and the low-precision copies. Each (param ∩ shard) piece is
one work item ([Note: one step loop] in steps.py) whose output is where the updated values
go (``ParamSink.piece_output``): the
kernel writes the bf16/fp16 copy straight into the param (CPU), into the staging buffer
(CUDA, copied to the device after the swapped step) or into the shard that is
all-gathered; fp32 params get the master copied into them. fp32 CPU params of a
partitioned group thus keep their master in the swap files too (4 B/param more disk
traffic than updating them in place; the in-place path is the stage-0 SwappedState).
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.memory import heap, paging
from offload.optim.flat import own_master
from offload.swap.manifest_check import check_identity
from offload.swap.pipeline import DEFAULT_MAX_HOST_BYTES, idle_votes, paged_bound, unpaged_bound
from offload.zero import comm

if TYPE_CHECKING:
    from offload.optim.swapped_shards import WorkItem
    from offload.optim.flat.store import FlatState

__all__ = ["open_swap", "params_from_swap", "SwapBacking", "swap_fields", "flat_identity", "agree_on_resumed_step",
           "resume_steps"]

log = logging.getLogger(__name__)


def open_swap(st: "FlatState", cfg: Any) -> None:
    """Open (or resume) this rank's swap files (``cfg``: the optimizer's OffloadConfig);
    every rank raises when one cannot."""
    # Several ranks: the swap steps' vote (see [Note: ranks vote before commit] in
    # swap/pipeline.py), also cast by a rank that holds no element at all.
    st._swap_vote = functools.partial(comm.failed_ranks, group=st.group) if st.world > 1 else None

    def open_local() -> None:
        from offload.optim.swapped_shards import SwappedShards

        sizes = [fg.layout.shard for fg in st._groups]
        if not sum(sizes):
            return  # no element at all on this rank
        me = weakref.ref(st)
        identity = flat_identity(st.world, st.rank, st._groups)
        bound = paged_bound(cfg.max_host_bytes, swap_fields(st), _paged_bytes(st), cfg.sub_group_size)

        def check(extra: Dict[str, Any], store: Any) -> bool:  # [Note: same identity] in swap/runs.py
            check_identity(identity, extra, store.path)
            return st.world == 1 and own_master.check_at_open(st, extra, store)  # several: check_resumed

        try:
            st._swap = SwappedShards(sizes, swap_dir=cfg.swap_dir, identity=identity, check_resume=check,
                                     extra=lambda: _extra(me()),
                                     max_host_bytes=bound, sub_group_size=cfg.sub_group_size,
                                     verify=cfg.verify, resume=cfg.resume, io_engine=cfg.io,
                                     backend=st._backend, num_threads=st._threads, rank=_dir_rank(st),
                                     run_name="flat", vote=st._swap_vote, fields=swap_fields(st),
                                     rule=st.rule, stochastic_states=getattr(st, "stochastic_states", False),
                                     padded_ends=any(f.blocked for f in st.rule.fields))  # params on whole blocks
        except ValueError as exc:
            asked = DEFAULT_MAX_HOST_BYTES if cfg.max_host_bytes is None else int(cfg.max_host_bytes)
            need = getattr(exc, "buffer_bytes", None)
            if need is None or not _paged_bytes(st) or cfg.sub_group_size is not None:
                raise  # the bound was not shrunk (paged_bound): the message names the caller's
            # the message named the shrunk bound, and its "at least" was shrunk again when passed
            least = unpaged_bound(need, swap_fields(st), _paged_bytes(st))
            kept = getattr(exc, "resume_sub_group", None)  # the resume path's layout (swap/runs.py)
            of = "" if kept is None else f" of the swap directory to resume (written with sub_group_size={kept})"
            then = "" if kept is None else (" to resume it; to change the layout, save_checkpoint() and "
                                            "load_checkpoint() into a new run")
            raise ValueError(f"max_host_bytes={asked} is too small with the params on NVMe: {bound} of it is left to "
                             f"the pipeline buffers{of} (the rest holds the paged grads and params of the sub-group "
                             f"being stepped), which need {need}; pass max_host_bytes >= {least}{then}") from exc
        if st._swap.resumed:  # resume="auto" chose, "discard" never resumes ([Note: restarts] in swap/runs)
            # The master of the last finished step is the truth: steps and params follow it.
            resume_steps(st)
        else:
            st._swap.initialise(lambda k, lo, hi, out: st._groups[k].shard_values(lo, hi, out))

    try:
        # Several ranks agree before anything collective follows: a rank that cannot open
        # or resume its swap files (a full disk, a missing directory) makes every rank raise.
        comm.on_every_rank(open_local, f"opening the swap files in {cfg.swap_dir!r}", st.group, st.world)
        if cfg.resume is True and st.world > 1:  # the params follow, from the step agreed on
            agree_on_resumed_step(st._swap, st.group, cfg.swap_dir, lambda: resume_steps(st))
        if cfg.resume is True or (st._swap is not None and st._swap.resumed):  # "auto": one rank only
            params_from_swap(st)  # every rank: an all-gather when partitioned
            comm.on_every_rank(lambda: own_master.check_resumed(st, cfg.swap_dir), "checking the resumed params",
                               st.group, st.world)  # [Note: own-master fingerprint]
    except BaseException:
        if st._swap is not None:
            st._swap.close(remove=not st._swap.resumed)  # keep what we were asked to resume
            st._swap = None
        raise


def resume_steps(st: "FlatState") -> None:
    """The step counts (and the optimizer's commit_meta) of the resumed commit."""
    extra = st._swap.resumed_extra
    st._set_steps(extra.get("steps") or [])
    st.ctx.resumed_from(extra)


def _extra(st: Optional["FlatState"]) -> Dict[str, Any]:
    """What each commit records with the data: the per-param steps, and the fingerprint of
    params that are their own master ([Note: own-master fingerprint] in own_master.py)."""
    if st is None:
        return {"steps": []}
    out: Dict[str, Any] = {"steps": st._ckpt_steps(), **st.ctx.commit_extra()}
    own = own_master.fingerprint(st)
    if own is not None:
        out[own_master.KEY] = own
    return out


def flat_identity(world: int, rank: int, groups: Any) -> Dict[str, Any]:
    """What must match on resume (world, rank, each param's numel, shape and dtype): runs.py."""
    return {"kind": "flat", "world": world, "rank": rank, "groups": [list(fg.layout.numels) for fg in groups],
            "shapes": [[[*p.shape, str(p.dtype)] for p in fg.params] for fg in groups]}


def agree_on_resumed_step(swap: Any, group: Any, swap_dir: Any, reset: Callable[[], None]) -> None:
    """The ranks' resumed swap files (``swap``: this rank's SwappedShards, or None when it holds
    none) must hold one step. A rank one step ahead whose free slots still hold the others' step
    goes back to it and ``reset()`` re-reads what follows the files (the step counts, the
    params) ([Note: a rank one step ahead] in swap/agreement.py); else every rank raises. A
    collective: every rank of ``group`` calls it."""
    store = swap.store if swap is not None else None
    what = f"resuming the swap files in {swap_dir!r}"
    want = comm.agree_on_step(None if store is None else store.step, None if store is None else store.previous_step,
                              what, group)

    def go_back() -> None:
        if store is not None and want != store.step:
            ahead = store.step
            swap.roll_back()
            log.warning("%s: went back from step %d to step %d, the other ranks' (the job died between the ranks' "
                        "commits; the swap files still held step %d)", store.path, ahead, store.step, store.step)
            reset()

    comm.on_every_rank(go_back, what, group)  # a rank whose manifest write fails: every rank raises


def _dir_rank(st: "FlatState") -> int:
    """The rank in the swap directory's name: the store's own, or for an unpartitioned store
    in a job of several ranks (stage 3's shards, stage 0) the job's, so ranks that share a
    swap_dir do not all take rank 0's directory (rank 1 then found it busy)."""
    if st.world == 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return st.rank


def _paged_bytes(st: "FlatState") -> int:
    """Bytes per element a step brings into RAM beside the buffers when the params are paged
    (params on NVMe): the grad, the next sub-group's grad read ahead, the updated param."""
    ps = [p for fg in st._groups for p in fg.params]
    return 3 * max(p.element_size() for p in ps) if any(paging.paged(p) for p in ps) else 0


def swap_fields(st: "FlatState") -> Any:
    """What the flat groups keep per element, in host buffers or swap files and checkpoints:
    the master and the rule's states (no master when bf16 params are their own,
    master_dtype="bfloat16": the flat groups say)."""
    return st._groups[0].fields if st._groups else st.rule.with_master()


def params_from_swap(st: "FlatState") -> None:
    """Every param <- its master in the swap files (resume, load_checkpoint); without a
    master in them (bf16 params that are their own) the params are the truth already."""
    def emit() -> None:
        if st._swap is not None and st._swap.has_master:
            outs, posts = st._sink.all_outputs(st._groups)
            st._swap.emit_all(outs)
            for post in posts:
                post()

    # A rank whose swap reads fail must not leave the others in the all-gather below.
    comm.on_every_rank(emit, "rebuilding the params from the swap files", st.group, st.world)
    if st.world > 1:
        for fg in st._groups:
            if fg.master_lowp:  # the params are the master: the rank's shard <- them, not the reverse
                fg.refresh_lowp_shard()
            fg.all_gather_params(st.group)
    st._sink.end()


class SwapBacking:
    """The states in swap files: the items of a step are collected, then the swap pipeline
    streams them (read g+1 / compute g / write g-1) and commits; what the sink sends to the
    params follows the commit, and with several ranks every group is all-gathered then."""

    cuts = False  # the swap pipeline cuts its own sub-groups

    def __init__(self, st: "FlatState") -> None:
        self._st = st
        self._items: List[Tuple[Any, ...]] = []
        self._posts: List[Callable[[], None]] = []

    def compute(self, item: "WorkItem") -> None:
        if item.mode == "lowp" and self._st.master_lowp:
            # a bf16 param that is its own master: the swap files keep no master, and the
            # item's output is what the kernel steps ("master" in swapped_shards' terms)
            item = item._replace(mode="master")
        self._items.append(item._replace(then=None))  # the sink runs `then` after the swap step
        if item.then is not None:
            self._posts.append(item.then)

    def finish(self, phases: Dict[str, float]) -> None:
        st, items = self._st, self._items
        # Several ranks: every rank steps and votes (see [Note: ranks vote before commit] in
        # swap/pipeline.py), even with nothing of its own to step or no element at all.
        if st._swap is not None and (items or st.world > 1):
            if _paged_bytes(st):  # the forward + backward's free heap out before the step's pages come in:
                heap.trim_heap()  # its RAM bound counts buffers and pages only ([Note: trimming the heap])
            phases.update(st._swap.step(items))
        elif st._swap_vote is not None:
            idle_votes(st._swap_vote)
        t = time.perf_counter()
        for post in self._posts:  # staging -> device (async on the copy stream), or non-contiguous params
            post()
        phases["h2d"] += time.perf_counter() - t
        t = time.perf_counter()
        st._sink.gather_all(st._groups)
        phases["allgather"] += time.perf_counter() - t
