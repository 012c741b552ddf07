"""CUDA streams emulated on the CPU, so the flat store's CUDA path runs in CI (no GPU there).

The params stay on the CPU. ``Emulation.install`` makes the flat store take the CUDA path
for them: the grad hook copies into a host buffer (``copy_cpu_grads``), bf16/fp16 params are
sent through the staging buffer and fp32 params from their master (``stage_cpu_params``, the
flat store for fp32 too), the host buffers come from the "pinned" pool (a fake cudart), and
each device gets a (grad, copy) pair of ``EmulatedStream`` (``FlatState.side_streams``).

An async copy issued on an emulated stream (``dst.copy_(src, non_blocking=True)`` inside its
``context()``) does not happen when it is issued: it is queued, as on a GPU, and runs

- when the host synchronises that stream (``synchronize()``), always;
- when the compute stream is made to wait for it (``current_waits()``), unless ``lazy``;
- with ``lazy``: before the next copy on the compute stream (a plain ``copy_`` from or to a
  tensor given to ``on_device``; any plain copy if none was), the latest a GPU may run it.

So a host read of a queued copy's destination sees stale bytes, and a host write to a queued
copy's source - on a GPU the copy would read some old and some new bytes - makes the copy
write NaN where the source changed (each source is snapshotted when its copy is queued): a
torn copy that is used shows in the tests' numerics, one that is overwritten before anyone
reads it (the hook copying an accumulated grad again) harmlessly does not. ``torn`` lists
them, for the failure message.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, List, Tuple

import torch

_REAL_COPY = torch.Tensor.copy_


class EmulatedStream:
    def __init__(self, emu: "Emulation", device: torch.device, name: str) -> None:
        self.emu, self.device, self.name = emu, device, name
        self.queue: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.stream = self
        self.kept: List[torch.Tensor] = []

    def run_queued(self) -> None:
        queue, self.queue = self.queue, []
        for dst, src, snap in queue:
            changed = _changed(snap, src)
            if changed is None:
                _REAL_COPY(dst, src)
                continue
            self.emu.torn.append(f"{self.name} stream: the host changed {int(changed.sum())} of {src.numel()} "
                                 f"elements of a queued copy's source ({src.dtype}) before it ran")
            torn = src.detach().clone()
            torn.view(-1)[changed.view(-1)] = float("nan")
            _REAL_COPY(dst, torn)
        self.kept.clear()

    # the SideStream interface (offload/zero/streams.py)
    active = True

    def wait_current(self) -> None:
        pass  # the CPU "compute stream" has finished everything the host has issued

    def current_waits(self) -> None:
        if not self.emu.lazy:
            self.run_queued()

    def keep_alive(self, t: torch.Tensor) -> None:
        self.kept.append(t)

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        self.run_queued()

    def context(self):
        return _On(self.emu, self)


def _changed(snap: torch.Tensor, src: torch.Tensor):
    """Mask of the elements whose bits differ (None: none), NaN-safe."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    mask = snap.contiguous().view(bits) != src.detach().contiguous().view(bits)
    return mask if bool(mask.any()) else None


class _On:
    def __init__(self, emu: "Emulation", stream: EmulatedStream) -> None:
        self.emu, self.stream = emu, stream

    def __enter__(self) -> None:
        self.prev = getattr(self.emu.tls, "stream", None)
        self.emu.tls.stream = self.stream

    def __exit__(self, *exc: Any) -> bool:
        self.emu.tls.stream = self.prev
        return False


class _FakeCudart:
    def cudaHostRegister(self, addr, size, flags):
        return 0

    def cudaHostUnregister(self, addr):
        return 0


class Emulation:
    def __init__(self, lazy: bool = False) -> None:
        self.lazy = lazy
        self.tls = threading.local()
        self.streams: List[EmulatedStream] = []
        self.torn: List[str] = []
        self.queued: Counter = Counter()  # async copies issued, per stream ("grad", "copy")
        self.device_storages: set = set()

    def on_device(self, tensors) -> None:
        """These tensors stand for device memory (lazy: only copies touching them are
        compute-stream work; a host read of a pinned buffer waits for nothing on a GPU)."""
        self.device_storages.update(t.untyped_storage().data_ptr() for t in tensors)

    def _is_device(self, t: Any) -> bool:
        return not self.device_storages or (isinstance(t, torch.Tensor) and
                                            t.untyped_storage().data_ptr() in self.device_storages)

    def _copy(self, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        stream = getattr(self.tls, "stream", None)
        if stream is not None and non_blocking and isinstance(src, torch.Tensor):
            stream.queue.append((dst, src, src.detach().clone()))
            self.queued[stream.name] += 1
            return dst
        if self.lazy and (self._is_device(dst) or self._is_device(src)):
            for s in self.streams:  # a compute-stream copy runs after what it was made to wait for
                s.run_queued()
        return _REAL_COPY(dst, src, non_blocking)

    def _pair(self, device: torch.device) -> Tuple[EmulatedStream, EmulatedStream]:
        pair = (EmulatedStream(self, device, "grad"), EmulatedStream(self, device, "copy"))
        self.streams.extend(pair)
        return pair

    def drain(self) -> None:
        """What torch.cuda.synchronize() is to a test: every queued copy has run."""
        for s in self.streams:
            s.run_queued()

    def install(self, monkeypatch) -> "Emulation":
        import offload.memory.pool as pool_mod
        import offload.memory.region as region_mod
        from offload.optim import adam
        from offload.optim.flat_state import FlatState

        monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False: self._copy(dst, src, non_blocking))
        monkeypatch.setattr(FlatState, "side_streams", staticmethod(self._pair))
        monkeypatch.setattr(FlatState, "copy_cpu_grads", True)
        monkeypatch.setattr(FlatState, "stage_cpu_params", True)
        monkeypatch.setattr(FlatState, "default_sub_group", 4096)  # several copies in flight per param
        monkeypatch.setattr(pool_mod, "cuda_pin_available", lambda: True)
        monkeypatch.setattr(region_mod, "_cudart", lambda: _FakeCudart())

        def flat_store_always(opt, stage, process_group):  # fp32 "device" params take it too
            opt.stage = 0 if stage is None else stage
            return FlatState.for_optimizer(opt, stage=opt.stage, process_group=process_group)

        monkeypatch.setattr(adam._AdamBase, "_make_store", flat_store_always)
        return self
