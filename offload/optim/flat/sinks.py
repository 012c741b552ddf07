"""Where the flat store's updated params go.

- in place: the kernel writes the bf16/fp16 copy of the updated master straight into a CPU
  param (``FlatGroup.flat_param``), or the fp32 master is copied into an fp32 param;
- staging + copy stream: for a CUDA param, the kernel writes into a pinned staging buffer
  and the param's device copy stream takes it to the device while the CPU computes the
  next sub-group ([Note: streams of the flat store] in offload/zero/streams.py);
- all-gather: several ranks, each updates its shard and the buckets are all-gathered, each
  as soon as its kernel is done ([Note: all-gather overlap]).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Dict, List, Tuple

import torch

from offload.zero.flat_group import FlatGroup

__all__ = ["ParamSink", "BucketGathers", "drain_streams", "drain_at_collection"]

log = logging.getLogger("offload.optim")


class ParamSink:
    """Sends updated values to the params; ``streams`` is the store's (grad, copy) pair per device."""

    def __init__(self, streams: Dict[torch.device, Tuple[Any, Any]], *, world: int,
                 overlap: Callable[[], bool]) -> None:
        self._streams, self.world, self._overlap = streams, world, overlap  # FlatState.overlap, read at each copy

    def begin(self) -> None:
        """Before a step's copies: they overwrite params that kernels queued on the compute
        stream may still read, and reuse staging the last step's copies may still read."""
        for _, copy_stream in self._streams.values():
            copy_stream.synchronize()
            copy_stream.wait_current()

    def end(self) -> None:
        """After a step's copies: the next forward reads the params copied."""
        for _, copy_stream in self._streams.values():
            copy_stream.current_waits()

    def to_param(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Updated values -> (a range of) a param; for a CUDA param on its device's copy
        stream, so the CPU goes on with the next sub-group meanwhile."""
        _, copy_stream = self._streams.get(dst.device, (None, None))
        if copy_stream is not None and self._overlap():
            with copy_stream.context():
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def piece_output(self, fg: FlatGroup, i: int, pc, start: int):
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
            return stage, "lowp", lambda: self.to_param(
                p.detach().view(-1)[pc.param_offset:pc.param_offset + pc.numel], stage)
        if dst is not None:
            return dst, ("lowp" if fg.lowp else "copy"), None
        tmp = torch.empty(pc.numel, dtype=p.dtype)  # non-contiguous CPU param: via a copy

        def put_back() -> None:
            whole = p.detach().reshape(-1).clone()
            whole[pc.param_offset:pc.param_offset + pc.numel].copy_(tmp)
            p.detach().copy_(whole.view_as(p))
        return tmp, ("lowp" if fg.lowp else "copy"), put_back

    def all_outputs(self, groups: List[FlatGroup]):
        """(outputs, posts) of every piece this rank owns, for the swap layer's emit_all."""
        outs, posts = [], []
        for k, fg in enumerate(groups):
            start = fg.layout.shard_range()[0]
            for i in range(len(fg.params)):
                pc = fg.layout.owned(i)
                if pc is not None:
                    out, mode, post = self.piece_output(fg, i, pc, start)
                    outs.append((k, pc.lo - start, pc.hi - start, out, mode))
                    if post is not None:
                        posts.append(post)
        return outs, posts


# [Note: all-gather overlap] Several ranks: the shard is stepped bucket by bucket (the
# buckets of the grad reduction) and each bucket's all-gather starts as soon as its
# kernel is done, so it travels while the CPU computes the next bucket; two are in
# flight at once (gather slots 0 and 1, see FlatGroup.all_gather_bucket_async). Every
# rank gathers every bucket in the same order (a collective), whether or not its own
# part of the bucket had grads. With NCCL the gather runs on NCCL's stream; with gloo on
# gloo's thread.
class BucketGathers:
    """The all-gathers of one group's buckets in flight, at most two at once."""

    def __init__(self, fg: FlatGroup, group: Any) -> None:
        self._fg, self._group = fg, group
        self._pending: deque = deque()

    def start(self, k: int, a: int, b: int) -> None:
        """Start bucket ``k`` (shard range a:b), first finishing the oldest when two fly."""
        if len(self._pending) == 2:
            self._finish_one()
        self._pending.append(self._fg.all_gather_bucket_async(a, b, k % 2, self._group))

    def finish(self) -> None:
        while self._pending:
            self._finish_one()

    def _finish_one(self) -> None:
        work, finish = self._pending.popleft()
        work.wait()
        finish()


def drain_streams(streams: Dict[torch.device, Tuple[Any, Any]]) -> None:
    for grad_stream, copy_stream in streams.values():
        grad_stream.synchronize()
        copy_stream.synchronize()


def drain_at_collection(streams: Dict[torch.device, Tuple[Any, Any]]) -> None:
    # An optimizer dropped without close(): its pools unpin and unmap their buffers when they
    # are collected, right after this runs (weakref callbacks come first), and a copy still
    # queued on a side stream must not find its memory gone.
    try:
        drain_streams(streams)
    except Exception as exc:  # CUDA already torn down: nothing is queued any more
        log.debug("flat store: draining side streams at collection: %s", exc)
