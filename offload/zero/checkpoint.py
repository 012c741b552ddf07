"""Checkpoints of flat groups as per-rank shards, loadable on any number of ranks.

[Note: flat checkpoints] ``save_shards(DIR)`` writes, per rank, ``DIR/rank<r>/`` with that
rank's shards of master, exp_avg and exp_avg_sq (the swap layer's streamed checkpoint
format, ``offload.swap.checkpoint.save_tensors``) and a meta block with the world size, the
numels of each flat group and whatever the caller adds (the optimizer: every param's step).
``load_shards(DIR)`` on M ranks reads the N shards back through the same ``FlatLayout``
arithmetic and keeps, on each rank, the intersection with its new shard: N -> M with no
gather and no full copy in memory (one old shard at a time).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import torch

from offload.swap.checkpoint import load_tensors, read_manifest, save_tensors
from offload.zero.flat_group import FlatGroup
from offload.zero.partition import FlatLayout

__all__ = ["save_shards", "load_shards", "STATES"]

STATES = ("master", "exp_avg", "exp_avg_sq")


def save_shards(directory: str, groups: List[FlatGroup], *, world: int, rank: int, meta: Dict[str, Any],
                process_group: Any = None) -> None:
    states = {k: [getattr(fg, k) for fg in groups if fg.layout.shard] for k in STATES}
    full_meta = dict(meta, kind="flat", world=world, rank=rank, groups=[list(fg.layout.numels) for fg in groups])
    save_tensors(os.path.join(directory, f"rank{rank}"), states, full_meta)
    if world > 1:
        torch.distributed.barrier(group=process_group)  # every shard is on disk before anyone returns


def load_shards(directory: str, groups: List[FlatGroup]) -> Dict[str, Any]:
    """Fill the groups' shards from checkpoint ``directory``; returns rank 0's meta."""
    first = read_manifest(os.path.join(directory, "rank0")).get("meta", {})
    old_world = int(first.get("world", 0))
    mine = [list(fg.layout.numels) for fg in groups]
    if first.get("kind") != "flat" or first.get("groups") != mine or old_world < 1:
        raise ValueError(f"{directory}: not a flat-store checkpoint of these params "
                         f"(its groups {first.get('groups')}, ours {mine})")
    for r in range(old_world):
        olds = [FlatLayout(n, old_world, r) for n in mine]
        scratch = {k: [torch.empty(lay.shard) for lay in olds if lay.shard] for k in STATES}
        meta = load_tensors(os.path.join(directory, f"rank{r}"), scratch)
        if meta.get("rank") != r or meta.get("world") != old_world:
            raise ValueError(f"{directory}/rank{r}: meta says rank {meta.get('rank')} of {meta.get('world')}")
        it = {k: iter(v) for k, v in scratch.items()}
        for fg, lay in zip(groups, olds):
            if not lay.shard:
                continue
            src = {k: next(it[k]) for k in STATES}
            o0, o1 = lay.shard_range()
            n0, n1 = fg.layout.shard_range()
            a, b = max(o0, n0), min(o1, n1, fg.layout.total)
            if a < b:
                for k in STATES:
                    getattr(fg, k)[a - n0:b - n0].copy_(src[k][a - o0:b - o0])
    return first
