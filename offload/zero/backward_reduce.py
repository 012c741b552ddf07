"""Gradient reduction started during backward, from the grad hooks (opt-in).

[Note: reduce in backward] With ``reduce_in_backward``, a post-accumulate-grad hook on
every param counts the params of each bucket that have their grad; buckets are started
(upcast into a send buffer, then an async reduce-scatter / all-reduce) strictly in one
fixed order, the same on every rank, as soon as the next bucket in that order is
complete; at the end of each backward pass (an autograd engine callback) the rest are
started, params without grad counting as zeros. So every rank issues the same
collectives in the same order, once per backward pass (ranks must run the same number
of backward passes per step). At step time each rank checks that the grads of every
bucket are still those it sent (same tensor, same version counter: a later micro-batch
of gradient accumulation or an in-place clip changes them; ``GradScaler.unscale_``, which
does not bump versions, is caught by the store, which then calls ``forget()``); one all-reduce
makes that check global, and the buckets any rank finds stale are reduced again, by
all ranks, synchronously. With accumulation over K passes the reduction runs K times
(the last one overlaps the last backward); send buffers: `inflight` buckets.

With ``release`` ([Note: releasing grads] in offload/optim/flat/grads.py) the buckets are
contiguous ranges of the flat buffer (``FlatGroup.owned_ranges``), each part summed into the
rank that owns it (``reduce``, not reduce-scatter): a reduce-scatter bucket takes the same
offsets of every rank's shard, so the first one would wait for grads from the middle of the
model (N-1 of N of the grads alive at once); a contiguous one is complete once backward has
passed it, as the planner assumes. Each grad is freed (``p.grad = None``) once the last bucket
in the order that holds part of it is sent, and a later pass of the same step adds its sum into
the shard instead of replacing it; at step time a bucket is stale when one of its params holds
a grad again (left there by ``no_sync()``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.zero import comm
from offload.zero.flat_group import FlatGroup

__all__ = ["BackwardReducer"]


class BackwardReducer:
    """Starts the bucketed reduction of ``groups`` from post-accumulate-grad hooks."""

    def __init__(self, groups: List[FlatGroup], *, group: Any, stage: int, comm_dev: torch.device,
                 inflight: int, disabled: Callable[[], bool], release: bool = False) -> None:
        self.groups = groups
        self.release = release
        self.group, self.stage, self.inflight = group, stage, inflight
        self._disabled = disabled
        self._members = [fg.owned_members() if release else fg.bucket_members() for fg in groups]
        self._order = [(gi, k) for gi in reversed(range(len(groups))) for k in reversed(range(len(self._members[gi])))]
        for fg in groups:
            W, c = fg.world, fg.chunk
            fg.slots = [torch.empty(W * c, dtype=torch.float32, device=comm_dev) for _ in range(inflight)]
            if comm_dev.type != "cpu" and not release:  # (release: the sum lands in the send slot)
                fg.slot_out = [torch.empty(c, dtype=torch.float32, device=comm_dev) for _ in range(inflight)]
        self._next = 0
        self._fired: set = set()
        self._cb = False
        self._seq = 0
        self._slot: List[Optional[Tuple[Any, Any, Tuple[int, int]]]] = [None] * inflight
        self._tags: Dict[Tuple[int, int], list] = {}
        self.closed = False
        # release: the params whose last bucket (in the order) each bucket is; the buckets sent
        # since the step (a later pass adds); the params whose grads were sent and freed
        self._last: Dict[Tuple[int, int], List[int]] = {}
        for gi, k in self._order:
            for i in self._members[gi][k]:
                self._last[(gi, i)] = (gi, k)  # the last in the order wins
        self._frees: Dict[Tuple[int, int], List[int]] = {}
        for (gi, i), key in self._last.items():
            self._frees.setdefault(key, []).append(i)
        self._sent: set = set()
        self.released: set = set()
        self.peak_numel = 0
        """release: the most grad elements alive when a bucket was sent."""

    def register(self) -> list:
        """Hook every param that takes grads; returns the hook handles."""
        handles = []
        me = weakref.ref(self)  # the params outlive us: their hooks must not keep us alive

        def hook(p: torch.Tensor, key: Tuple[int, int]) -> None:
            reducer = me()
            if reducer is not None:
                reducer._hook(key)
        for gi, fg in enumerate(self.groups):
            for i, p in enumerate(fg.params):
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, key=(gi, i): hook(p, key)))
        return handles

    def forget(self) -> None:
        """Treat every bucket sent so far as stale (grads changed behind our back)."""
        self._tags = {}

    def _hook(self, key: Tuple[int, int]) -> None:
        if self.closed or self._disabled():
            return
        self._fired.add(key)
        if not self._cb:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._cb = True
        self._advance(final=False)

    def _end_backward(self) -> None:
        self._advance(final=True)
        self._next, self._fired, self._cb = 0, set(), False

    def _advance(self, final: bool) -> None:
        while self._next < len(self._order):
            gi, k = self._order[self._next]
            fg = self.groups[gi]
            if not final and any(fg.params[i].requires_grad and (gi, i) not in self._fired
                                 for i in self._members[gi][k]):
                return
            self._launch(gi, k)
            self._next += 1

    def _wait_slot(self, slot: int) -> None:
        held = self._slot[slot]
        if held is not None:
            work, finish, _ = held
            work.wait()
            finish()
            self._slot[slot] = None

    def _launch(self, gi: int, k: int) -> None:
        for slot, held in enumerate(self._slot):  # a bucket's previous pass writes the same range
            if held is not None and held[2] == (gi, k):
                self._wait_slot(slot)
        slot = self._seq % self.inflight
        self._seq += 1
        self._wait_slot(slot)
        fg = self.groups[gi]
        work, finish = self._start(gi, k, slot)
        self._slot[slot] = (work, finish, (gi, k))
        if self.release:
            self._sent.add((gi, k))
            self._free(gi, k)
        else:
            self._tags[(gi, k)] = [_tag(fg.params[i].grad) for i in self._members[gi][k]]

    def _start(self, gi: int, k: int, slot: int):
        fg = self.groups[gi]
        if self.release:
            return fg.launch_owned(k, slot, self.group, accumulate=(gi, k) in self._sent)
        return fg.launch_bucket(k, slot, self.group, self.stage)

    def _free(self, gi: int, k: int) -> None:
        """release: bucket (gi, k) is sent (its send buffer filled): free the grads it was the last to need."""
        alive = sum(p.grad.numel() for fg in self.groups for p in fg.params if p.grad is not None)
        self.peak_numel = max(self.peak_numel, alive)
        for i in self._frees.get((gi, k), ()):
            p = self.groups[gi].params[i]
            if p.grad is not None:
                self.released.add(p)
                p.grad = None

    def drop_released(self) -> None:
        """The step consumed the sums (or zero_grad dropped them): the next pass replaces them."""
        self._sent = set()
        self.released = set()

    def finish(self) -> None:
        """At step time: every bucket's sum in its group's gshard (see the note)."""
        for slot in range(self.inflight):
            self._wait_slot(slot)
        ok = [int(self._current(gi, k)) for gi, k in self._order]
        flags = torch.tensor(ok, dtype=torch.int32, device=self.groups[0].send.device)
        comm.all_reduce(flags, self.group, op=torch.distributed.ReduceOp.MIN)
        for (gi, k), good in zip(self._order, flags.tolist()):
            if not good:  # stale on some rank: every rank reduces it again, now
                work, finish = self._start(gi, k, 0)
                work.wait()
                finish()
                self._sent.add((gi, k))
        if self.release:
            for gi, k in self._order:
                self._free(gi, k)
        self._tags = {}

    def _current(self, gi: int, k: int) -> bool:
        """Bucket (gi, k) in the shard is what its params' grads say (see the note)."""
        fg = self.groups[gi]
        if self.release:  # a grad still on a param has not been sent (no_sync)
            return all(fg.params[i].grad is None for i in self._members[gi][k])
        tags = self._tags.get((gi, k))
        return tags is not None and all(_same(t, fg.params[i].grad) for t, i in zip(tags, self._members[gi][k]))

    def close(self) -> None:
        for slot in range(self.inflight):
            self._wait_slot(slot)
        self.closed = True


def _tag(g: Optional[torch.Tensor]) -> Tuple[Any, int]:
    """(weak reference, version) of a grad, to tell whether it changed since it was sent."""
    return (None, -1) if g is None else (weakref.ref(g), g._version)


def _same(tag: Tuple[Any, int], g: Optional[torch.Tensor]) -> bool:
    if g is None or tag[0] is None:
        return g is None and tag[0] is None
    return tag[0]() is g and tag[1] == g._version
