"""Where the flat store's updated params go.

- in place: the kernel writes the bf16/fp16 copy of the updated master straight into a CPU
  param (``FlatGroup.flat_param``), or the fp32 master is copied into an fp32 param;
- staging + copy stream: for a CUDA param, the kernel writes into a pinned staging buffer
  and the param's device copy stream takes it to the device while the CPU computes the
  next sub-group ([Note: streams of the flat store] in offload/zero/streams.py);
- all-gather: several ranks, each updates its shard and the buckets are all-gathered, each
  as soon as its kernel is done ([Note: all-gather overlap]); with the states in swap files,
  once the swap step is committed.

The sink gives the step loop ([Note: one step loop] in steps.py) each piece's output
(``piece_output``), what to send once an item is computed (``after``), the segments a
group is stepped in (``segments``) and what happens at their ends (``segment_done``,
``group_done``).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.zero.flat_group import FlatGroup

__all__ = ["ParamSink", "BucketGathers", "drain_streams", "drain_at_collection"]

log = logging.getLogger("offload.optim")


class ParamSink:
    """Sends updated values to the params; ``streams`` is the store's (grad, copy) pair per device."""

    def __init__(self, streams: Dict[torch.device, Tuple[Any, Any]], *, world: int, group: Any = None,
                 gather_per_bucket: bool = True, overlap: Callable[[], bool]) -> None:
        self._streams, self.world, self._overlap = streams, world, overlap  # FlatState.overlap, read at each copy
        self._group = group
        # Several ranks with the states in host buffers: each bucket is gathered as soon as it
        # is stepped. In swap files: the whole shard once the swap step is committed.
        self._per_bucket = world > 1 and gather_per_bucket
        self._gathers: Optional[BucketGathers] = None

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

    def piece_output(self, fg: FlatGroup, pc, start: int):
        """(out, mode, send_to, finish) for piece ``pc``: where the updated values go (see
        WorkItem in steps.py and [Note: outputs] in swapped_shards.py), the param range
        ``out`` is sent to once computed (staging -> device), or what puts a non-contiguous
        param back after the whole piece."""
        s = slice(pc.lo - start, pc.hi - start)
        p = fg.params[pc.index]
        if self.world > 1 and fg.lowp:
            return fg.lowp_shard[s], "lowp", None, None  # all-gathered afterwards
        if self.world > 1 and not fg.swapped:
            return None, None, None, None  # fp32: the master itself is all-gathered
        ps = slice(pc.param_offset, pc.param_offset + pc.numel)
        mode = "lowp" if fg.lowp else "copy"
        if fg.stage is not None:  # one rank, device bf16/fp16: via the pinned staging
            return fg.stage[s], "lowp", p.detach().view(-1)[ps], None
        if p.is_contiguous():
            return p.detach().view(-1)[ps], mode, None, None
        tmp = torch.empty(pc.numel, dtype=p.dtype)  # non-contiguous CPU param: via a copy
        if fg.master_lowp:  # the kernel steps tmp as the param's own master: its values first
            tmp.copy_(p.detach().reshape(-1)[ps])

        def put_back() -> None:
            if pc.numel == p.numel():  # the whole param (one rank): no read-modify-write
                p.detach().copy_(tmp.view_as(p))
                return
            whole = p.detach().reshape(-1).clone()
            whole[ps].copy_(tmp)
            p.detach().copy_(whole.view_as(p))
        return tmp, mode, None, put_back

    def after(self, out: Optional[torch.Tensor], send_to: Optional[torch.Tensor], a: int, b: int,
              finish: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """What runs once piece elements [a, b) are computed: ``out`` -> ``send_to`` (on the
        copy stream), then ``finish`` (after a piece's last sub-group); None when nothing."""
        if send_to is None:
            return finish
        dst, src = send_to[a:b], out[a:b]
        if finish is None:
            return lambda: self.to_param(dst, src)

        def send_and_finish() -> None:
            self.to_param(dst, src)
            finish()
        return send_and_finish

    def all_outputs(self, groups: List[FlatGroup]):
        """(outputs, posts) of every piece this rank owns, for the swap layer's emit_all."""
        outs, posts = [], []
        for k, fg in enumerate(groups):
            start = fg.layout.shard_range()[0]
            for i in range(len(fg.params)):
                pc = fg.layout.owned(i)
                if pc is None:
                    continue
                out, mode, send_to, finish = self.piece_output(fg, pc, start)
                if out is None:
                    continue
                outs.append((k, pc.lo - start, pc.hi - start, out, mode))
                post = self.after(out, send_to, 0, pc.numel, finish)
                if post is not None:
                    posts.append(post)
        return outs, posts

    # ------------------------------------------------------------------ segments and gathers
    def segments(self, fg: FlatGroup) -> List[Tuple[int, int]]:
        """Shard-local ranges a group is stepped in: its buckets when each is gathered as
        soon as it is stepped, else the whole shard."""
        if self._per_bucket:
            return fg.bucket_ranges()
        return [(0, fg.layout.shard)] if fg.layout.shard else []

    def segment_done(self, fg: FlatGroup, k: int, a: int, b: int) -> None:
        """Segment ``k`` of ``fg`` is stepped: start its all-gather (a collective, on every rank)."""
        if not self._per_bucket:
            return
        if self._gathers is None:
            self._gathers = BucketGathers(fg, self._group)
        self._gathers.start(k, a, b)

    def group_done(self, fg: FlatGroup) -> None:
        """Every segment of ``fg`` is stepped: wait for its gathers (they write the params)."""
        if self._gathers is not None:
            gathers, self._gathers = self._gathers, None
            gathers.finish()

    def gather_all(self, groups: List[FlatGroup]) -> None:
        """Several ranks, not per bucket: every group's updated shard -> every rank's params."""
        if self.world > 1:
            for fg in groups:
                fg.all_gather_params(self._group)


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
