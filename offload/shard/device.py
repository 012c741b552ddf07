"""Stage 3 on a device (CUDA): the transfers of flat_unit.py and grads.py on side streams.

[Note: stage 3 on a device] A unit's ``full`` buffer lives on the device: its storage is
allocated when the unit is gathered (on the all-gather stream) and resized to 0 bytes when
it is released (``record_stream`` on the compute stream first, so the caching allocator
keeps it until the compute stream's reads are done); the views autograd saved stay the same
objects (FSDP2's way; flat_unit.py [Note: flat unit layout] says why the CPU path maps
pages instead). The shard lives on the device (``offload_params="none"``), in pinned host
memory ("cpu"), or in the tier's host pages ("nvme": copied into a pinned buffer and
evicted at once, so the pages never wait for the device). Two side streams per device:

- gather: ``wait_current()`` (the buffer's and the shard's last users on the compute
  stream come first), then the host-to-device copy of a host shard and the all-gather into
  ``full`` (NCCL queues it after this stream; one rank: a copy), and an event. ``wait()``
  makes the compute stream wait on the collective and the event: the host does not wait.
  A group whose collectives run on the host (gloo) all-gathers into a pinned host buffer on
  gloo's thread; ``wait()`` then queues that buffer's copy to the device on the gather
  stream (the host waits for gloo, never for the device).
- reduce: ``wait_current()`` (the grads were made on the compute stream), then the bucket's
  flatten and its reduce-scatter (NCCL; one rank: none); on a host group the bucket is
  copied to a pinned host buffer and the host waits for that copy before gloo reads it. The
  shard grad is made where the shard is: a device shard's on the compute stream after it
  waited for the reduction; a host shard's ("cpu"/"nvme") on the host, from this rank's
  part copied down on the reduce stream right after the collective, once the host waited
  for that copy (its event only: the compute stream runs on). The reducer retires every
  bucket before the backward ends, so before the optimizer reads a grad.

The schedule and the hooks do not know which path runs. ``side_streams`` lets the tests run
the path with CPU tensors standing for device memory (tests/stream_emulation.py), as
``FlatState.side_streams`` does for the stage-2 streams.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Tuple

import torch

from offload.memory import paging
from offload.zero import SideStream, comm

__all__ = ["Streams", "streams_for", "gather", "issue_bucket", "retire_bucket"]


_TUPLE_FORM = [True]  # tuples in the torch releases after 2.6 (2.13: tuples); 2.6: a tensor and an int


def set_version(t: torch.Tensor, version: int) -> None:
    """Set ``t``'s autograd version counter (``torch._C._autograd._unsafe_set_version_counter``,
    whose arguments are tuples of tensors and versions in today's torch, one tensor and an int in
    torch 2.6: a stage-3 forward failed there with a TypeError)."""
    setter = torch._C._autograd._unsafe_set_version_counter
    if _TUPLE_FORM[0]:
        try:
            setter((t,), (version,))
            return
        except TypeError:  # pybind's argument check: nothing was set
            _TUPLE_FORM[0] = False
    setter(t, version)


overlap = True
"""False: the gathers' copies and collectives go on the compute stream, in order (no side
stream): the baseline bench/shard_gpu.py measures the overlap against; read at each gather."""

side_streams: Optional[Callable[[torch.device], Tuple[Any, Any]]] = None
"""Tests: makes the (gather, reduce) pair of stream-like objects for CPU params, so that
``offload.shard`` takes the device path with them (tests/stream_emulation.py)."""


class _OnCompute:
    """A side stream's interface whose work goes on the current (compute) stream (``overlap``
    off): no waits are needed, everything runs in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wait_current(self) -> None:
        pass

    def current_waits(self) -> None:
        pass

    def record(self) -> None:
        return None

    def context(self):
        return contextlib.nullcontext()


class Streams:
    """The gather and reduce side streams of one device."""

    def __init__(self, device: torch.device, gather_stream: Any, reduce_stream: Any) -> None:
        self.device, self.gather, self.reduce = device, gather_stream, reduce_stream


def streams_for(device: torch.device) -> Optional[Streams]:
    """The side streams for params on ``device``; None: the CPU path (flat_unit.py)."""
    if device.type == "cuda":
        return Streams(device, SideStream(device), SideStream(device))
    if device.type == "cpu" and side_streams is not None:
        return Streams(device, *side_streams(device))
    return None


def host_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory an async copy to or from ``device`` may use (pinned on CUDA: the host
    allocator keeps it until the copies queued on it are done)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def compute_waits(side: Any, event: Any) -> None:
    """The compute stream's later work starts after ``event`` (recorded on ``side``; None:
    after all ``side`` has queued). The host does not wait."""
    if event is not None:
        torch.cuda.current_stream(side.device).wait_event(event)
    else:
        side.current_waits()


def host_waits(side: Any, event: Any) -> None:
    """The host waits for ``event`` (recorded on ``side``; None: for all ``side`` has queued)."""
    if event is not None:
        event.synchronize()
    else:
        side.synchronize()


def _collective_on_device(flat: Any) -> bool:
    """Whether the group's collectives take device tensors (NCCL), or there is none (one rank)."""
    if flat.world == 1:
        return True
    return flat.streams.device.type == "cuda" and comm.comm_device(flat.shard._offload_shard.group).type == "cuda"


# ---------------------------------------------------------------------- the full buffer
def alloc_full(flat: Any) -> None:
    storage = flat.full.untyped_storage()
    if storage.nbytes() == 0:
        with flat.streams.gather.context():  # the block belongs to the stream that writes it first
            storage.resize_(flat.nbytes)


def free_full(flat: Any) -> None:
    full = flat.full
    if full.untyped_storage().nbytes() == 0:
        return
    if full.is_cuda:  # written on the gather stream, read on the compute stream
        full.record_stream(torch.cuda.current_stream(full.device))
    full.untyped_storage().resize_(0)


# ---------------------------------------------------------------------- gathers
class _OnDevice:
    """A device gather's handle (see the note): ``wait()`` on the compute stream."""

    def __init__(self, flat: Any, side: Any, handle: Any, event: Any, out: Optional[torch.Tensor], version: int,
                 landing: Optional[torch.Tensor] = None) -> None:
        self.flat, self.side, self.handle, self.event, self.out = flat, side, handle, event, out
        self.version, self.landing = version, landing

    def wait(self) -> bool:
        done = self.handle.wait()  # NCCL: the compute stream waits for it; gloo: the host
        side = self.side
        if self.landing is not None:
            if self.out is not None:  # the host all-gather is done: now its copy to the device
                with side.context():
                    self.out.copy_(self.landing, non_blocking=True)
                self.event = side.record()
            self.landing = None
        if self.out is not None:
            compute_waits(side, self.event)
        if self.out is self.flat.full:  # the values autograd saved: as flat_unit._Kept does
            set_version(self.flat.full, self.version)
        return done


def _source(flat: Any) -> torch.Tensor:
    """The shard to send: the device shard, the pinned host shard, or the tier's pages copied
    into a pinned buffer (evicted at once: an async copy never reads evictable pages)."""
    src = flat.shard.detach()
    if flat.tier is None:
        return src
    paging.load([src])
    try:
        return host_buffer(src.numel(), src.dtype, flat.streams.device).copy_(src)
    finally:
        paging.evict([src])


def gather(flat: Any, group: Any, scratch: bool):
    """FlatParam.gather_async on the device path: (handle, scratch buffer or None)."""
    streams, dev = flat.streams, flat.streams.device
    side = streams.gather if overlap else _OnCompute(dev)
    src = _source(flat)
    side.wait_current()  # the buffer's last readers and the shard's last writer come first
    if not scratch:
        flat.alloc()
    version = flat.full._version
    if _collective_on_device(flat):
        with side.context():
            out = torch.empty(flat.padded, dtype=flat.dtype, device=dev) if scratch else flat.full
            if flat.world == 1:
                out.copy_(src, non_blocking=True)
                handle: Any = _Done()
            else:
                if src.device != dev:
                    staged = torch.empty(src.numel(), dtype=src.dtype, device=dev)
                    staged.copy_(src, non_blocking=True)
                    src = staged
                handle = comm.all_gather_async(out, src, group)
        event = side.record()
        return _OnDevice(flat, side, handle, event, out, version), (out if scratch else None)
    # collectives on the host (gloo): all-gather into pinned memory; its copy at wait()
    if src.device.type != "cpu":
        src = src.to("cpu")  # the device shard (after the compute stream's last write to it)
    landing = host_buffer(flat.padded, flat.dtype, dev)
    handle = comm.all_gather_async(landing, src, group)
    out = None if scratch else flat.full
    return _OnDevice(flat, side, handle, None, out, version, landing=landing), landing if scratch else None


class _Done:
    """The handle of a transfer that needed no collective (one rank)."""

    def wait(self) -> bool:
        return True


# ---------------------------------------------------------------------- reductions
class _Bucket:
    """A device bucket's handle: complete when its collective and its stream's work are."""

    def __init__(self, handle: Any, event: Any) -> None:
        self.handle, self.event = handle, event

    def is_completed(self) -> bool:
        done = getattr(self.handle, "is_completed", None)
        if done is not None and not done():
            return False
        return self.event is None or bool(self.event.query())

    def wait(self) -> bool:
        return self.handle.wait()


def issue_bucket(job: Any, group: Any) -> Tuple[Any, Any, torch.Tensor, int, bool]:
    """GradReducer._issue on the device path: the next bucket of ``job`` flattened and
    reduce-scattered from the reduce stream (see the note); the reducer's flying entry."""
    flat = job.flat
    side = flat.streams.reduce
    side.wait_current()  # the grads were made on the compute stream
    grads = [g for g, _, _ in job.grads]
    with side.context():
        buf, lo, hi = job.bucket()
    for g in grads:
        side.keep_alive(g)  # made on the compute stream, read here; the job may drop them now
    if _collective_on_device(flat):
        with side.context():
            if flat.world == 1:
                out, handle = buf, _Done()
            else:
                out = torch.empty(hi - lo, dtype=torch.float32, device=buf.device)
                handle = comm.reduce_scatter_async(out, buf, group)
            if flat.host_shard:  # its part goes down from here
                handle.wait()  # NCCL: this (the current) stream waits for the collective, the host does not
                down = host_buffer(hi - lo, torch.float32, flat.streams.device)
                down.copy_(out, non_blocking=True)
                out, handle = down, _Done()
        return _Bucket(handle, side.record()), flat, out, lo, job.fresh
    host = host_buffer(buf.numel(), torch.float32, flat.streams.device)
    with side.context():
        host.copy_(buf, non_blocking=True)
    side.synchronize()  # gloo reads host memory: the bucket must be there first
    out = torch.empty(hi - lo, dtype=torch.float32)
    return _Bucket(comm.reduce_scatter_async(out, host, group), None), flat, out, lo, job.fresh


def retire_bucket(entry: Tuple[Any, Any, torch.Tensor, int, bool]) -> None:
    """GradReducer._retire on the device path: the average of the reduced bucket goes into
    the shard's grad: on the compute stream after it waited for the reduction (a device
    shard), or on the host after it waited for the bucket's copy down (a host shard)."""
    h, flat, out, lo, fresh = entry
    h.wait()
    side = flat.streams.reduce
    if flat.host_shard and _collective_on_device(flat):
        host_waits(side, h.event)  # this bucket's copy down only, not the compute stream
    elif _collective_on_device(flat):  # the average is made from the reduce stream's output
        compute_waits(side, h.event)
        if out.is_cuda:  # made on the reduce stream; read (and maybe kept as the grad) on the compute stream
            out.record_stream(torch.cuda.current_stream(out.device))
    flat.add_shard_grad(out, lo, fresh)
