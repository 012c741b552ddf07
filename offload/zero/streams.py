"""CUDA side streams that become no-ops on the CPU, so one code path serves both.

[Note: streams of the flat store] Two side streams per device, each with one job:

- ``grad``: device-to-host copies of gradients, issued from the post-accumulate-grad hook;
  they overlap with the rest of the backward pass on the compute stream.
- ``copy``: host-to-device copies of the updated params, one per sub-group, issued as
  soon as the CPU kernel has finished that sub-group; they overlap with the CPU kernel of
  the next sub-group.

A tensor that crosses from the compute stream to a side stream is protected with
``record_stream`` (so the caching allocator does not hand its memory out while the copy
reads it), and the next user of a result waits on the producing stream's event, never on
the whole device.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SideStream"]


class SideStream:
    """A CUDA stream on ``device``, or nothing at all when ``device`` is not CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Optional["torch.cuda.Stream"] = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)

    @property
    def active(self) -> bool:
        return self.stream is not None

    def wait_current(self) -> None:
        """Work queued on this stream from now on starts after what the compute stream has queued."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def current_waits(self) -> None:
        """The compute stream's later work starts after what this stream has queued."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def record(self) -> Optional["torch.cuda.Event"]:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def keep_alive(self, t: torch.Tensor) -> None:
        """``t`` (made on the compute stream) is read by work queued here: the caching
        allocator must not hand its memory out before that work is done."""
        if self.stream is not None:
            t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until this stream's queued work is done."""
        if self.stream is not None:
            self.stream.synchronize()

    def context(self):
        """``with side.context():`` queues the enclosed CUDA work on this stream."""
        if self.stream is None:
            return _Null()
        return torch.cuda.stream(self.stream)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
