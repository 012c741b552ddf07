"""CUDA streams emulated on the CPU, so the flat store's CUDA path runs in CI (no GPU there).

The params stay on the CPU. ``Emulation.install`` makes the flat store take the CUDA path
for them: the grad hook copies into a host buffer (``copy_cpu_grads``), bf16/fp16 params are
sent through the staging buffer and fp32 params from their master (``stage_cpu_params``, the
flat store for fp32 too), the host buffers come from the "pinned" pool (a fake cudart), and
each device gets a (grad, copy) pair of ``EmulatedStream`` (``FlatState.side_streams``). The
params of every optimizer made meanwhile stand for device memory.

An async copy issued on an emulated stream (``dst.copy_(src, non_blocking=True)`` inside its
``context()``) does not happen when it is issued: it is queued, as on a GPU, and runs only
when a GPU would have had to run it:

- when the host synchronises its stream (``synchronize()``);
- when a compute-stream op touches device memory (any torch op on a param, seen through a
  ``TorchFunctionMode``: a forward, a read of the params) after the compute stream was made
  to wait for that stream (``current_waits()``): then the copies queued before that wait run.

So a host read of a queued copy's destination sees stale bytes; a compute-stream op that was
not made to wait sees stale params; and a host write to a queued copy's source - on a GPU
the copy would read some old and some new bytes - makes the copy write NaN where the source
changed (each source is snapshotted when its copy is queued): a torn copy that is used shows
in the tests' numerics, one that is overwritten before anyone reads it (the hook copying an
accumulated grad again) harmlessly does not. ``torn`` lists them, for failure messages.

Stage 3 (``install_stage3``, tests/test_shard_cuda.py): ``offload.shard`` takes its device
path (offload/shard/device.py) with a (gather, reduce) pair; every tensor stands for device
memory (``all_device``: the path's temporaries are made anywhere), a backward's read of a
saved tensor counts as a compute-stream op (a saved-tensors hook: autograd's engine runs
no Python op the mode could see), a queued copy moves its destination's version counter
when issued (``version_at_issue``, as torch does on a GPU), a unit's buffer released before
its queued copies ran drops them (on a GPU they write the memory ``record_stream`` kept),
and a copy whose source an earlier copy of the same queue writes is ordered by the stream,
not torn. In a backward, the copies the compute stream is made to wait for run at that wait:
the ops of a forward recomputed there (activation checkpointing) are not seen by the mode.

What it cannot show: the host running ahead of the device. Compute-stream ops run here when
the host issues them, so a host write racing device work that a GPU would still have queued
(the step's kernel against the last step's copies, which the step prevents by synchronising
the copy stream first) goes unseen; nor does it check ``wait_current`` or ``keep_alive``.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from offload.shard.device import set_version

_REAL_COPY = torch.Tensor.copy_


class EmulatedStream:
    def __init__(self, emu: "Emulation", device: torch.device, name: str) -> None:
        self.emu, self.device, self.name = emu, device, name
        self.queue: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.waited = 0  # queue[:waited] must run before the compute stream's next device op
        self.stream = self
        self.kept: List[torch.Tensor] = []

    def run_queued(self, upto: int = -1) -> None:
        n = len(self.queue) if upto < 0 else upto
        todo, self.queue = self.queue[:n], self.queue[n:]
        self.waited = max(0, self.waited - n)
        for dst, src, snap in todo:
            version = dst._version
            changed = None if snap is None else _changed(snap, src)
            if changed is None:
                _REAL_COPY(dst, src)
                self.emu.ran(dst, version)
                continue
            self.emu.torn.append(f"{self.name} stream: the host changed {int(changed.sum())} of {src.numel()} "
                                 f"elements of a queued copy's source ({src.dtype}) before it ran")
            torn = src.detach().clone()
            torn.view(-1)[changed.view(-1)] = float("nan")
            _REAL_COPY(dst, torn)
            self.emu.ran(dst, version)
        if not self.queue:
            self.kept.clear()

    def forget(self, storage: int) -> None:
        """The memory of storage ``storage`` (``_cdata``) is freed: its queued copies go (on a
        GPU they write the old block, which record_stream kept, and nobody reads it)."""
        keep = [(i, e) for i, e in enumerate(self.queue) if e[0].untyped_storage()._cdata != storage]
        self.waited = sum(1 for i, _ in keep if i < self.waited)
        self.queue = [e for _, e in keep]

    # the SideStream interface (offload/zero/streams.py)
    active = True

    def wait_current(self) -> None:
        pass  # the compute stream's ops ran when the host issued them (see the module's doc)

    def current_waits(self) -> None:
        self.waited = len(self.queue)
        if torch._C._current_graph_task_id() != -1:
            # in a backward the compute stream's next ops may be a forward recomputed there
            # (activation checkpointing), which the mode does not see: autograd's engine runs
            # without the thread's torch function modes. They come after this wait: run now.
            self.emu.run_waited()

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


# Ops that read no data of their tensors (shapes, aliases): no device work, no wait. An alias
# counts when an op reads through it.
_METADATA = {"view_as", "view", "reshape", "flatten", "detach", "size", "dim", "numel", "nelement", "stride",
             "storage_offset", "is_contiguous", "is_floating_point", "data_ptr", "untyped_storage",
             "element_size", "type", "__get__", "__len__", "__hash__", "__repr__", "__format__"}


class _ComputeStream(TorchFunctionMode):
    """Runs the copies the compute stream waits for before its next op on device memory."""

    def __init__(self, emu: "Emulation") -> None:
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        emu = self.emu
        if (getattr(emu.tls, "stream", None) is None and any(s.waited for s in emu.streams)
                and getattr(func, "__name__", "") not in _METADATA):
            if any(isinstance(t, torch.Tensor) and (emu.all_device or emu.is_device(t))
                   for t in tree_leaves((args, kwargs))):
                emu.run_waited()
        return func(*args, **kwargs)


class _FakeCudart:
    def cudaHostRegister(self, addr, size, flags):
        return 0

    def cudaHostUnregister(self, addr):
        return 0


class Emulation:
    """``all_device``: every tensor stands for device memory (stage 3: the gathers' and
    reductions' temporaries are made anywhere), and a backward's read of a saved tensor is a
    compute-stream op too (autograd's engine runs no Python op the mode could see: a
    saved-tensors hook stands in). ``version_at_issue`` (the default): a queued copy bumps its
    destination's version counter when issued, as torch does on a GPU, not when it runs (the
    flat store records the params' versions after its step's copies are issued: [Note: params
    written by others])."""

    def __init__(self, all_device: bool = False, version_at_issue: bool = True) -> None:
        self.all_device, self.version_at_issue = all_device, version_at_issue
        self.tls = threading.local()
        self.streams: List[EmulatedStream] = []
        self.torn: List[str] = []
        self.queued: Counter = Counter()  # async copies issued, per stream ("grad", "copy")
        self.device_storages: set = set()
        self._device_refs: List[torch.Tensor] = []

    def on_device(self, tensors) -> None:
        """These tensors stand for device memory (kept alive: a freed one's address could be
        handed to a host tensor next)."""
        for t in tensors:
            self._device_refs.append(t)
            self.device_storages.add(t.untyped_storage().data_ptr())

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device_storages

    def _copy(self, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        stream = getattr(self.tls, "stream", None)
        if stream is not None and non_blocking and isinstance(src, torch.Tensor):
            # a source an earlier copy of this queue writes is written in stream order: not torn
            chained = src.untyped_storage()._cdata in {d.untyped_storage()._cdata for d, _, _ in stream.queue}
            stream.queue.append((dst, src, None if chained else src.detach().clone()))
            self.queued[stream.name] += 1
            if self.version_at_issue:
                set_version(dst, dst._version + 1)
            return dst
        return _REAL_COPY(dst, src, non_blocking)

    def ran(self, dst: torch.Tensor, version: int) -> None:
        """A queued copy into ``dst`` ran (its version moved at issue: ``version_at_issue``)."""
        if self.version_at_issue:
            set_version(dst, version)

    def run_waited(self) -> None:
        """A compute-stream op: the copies it was made to wait for run first."""
        if getattr(self.tls, "stream", None) is None:
            for s in self.streams:
                if s.waited:
                    s.run_queued(s.waited)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.run_waited()  # the backward reads a saved tensor
        return t

    def _shard_pair(self, device: torch.device) -> Tuple[EmulatedStream, EmulatedStream]:
        pair = (EmulatedStream(self, device, "gather"), EmulatedStream(self, device, "reduce"))
        self.streams.extend(pair)
        return pair

    def install_stage3(self, monkeypatch, optimizer: bool) -> "Emulation":
        """``offload.shard`` takes its device path (offload/shard/device.py) for CPU params
        with a (gather, reduce) pair of emulated streams; ``optimizer``: the optimizer steps
        the shards as device params too (offload_params="none"; else they are host memory,
        stepped in place as on a GPU)."""
        from offload.shard import device

        self.all_device = self.version_at_issue = True
        monkeypatch.setattr(device, "side_streams", self._shard_pair)
        free_full = device.free_full

        def free(flat):  # a CPU storage resized to 0 and back is the same storage: forget its copies
            for s in self.streams:
                s.forget(flat.full.untyped_storage()._cdata)
            free_full(flat)
        monkeypatch.setattr(device, "free_full", free)
        return self.install(monkeypatch, optimizer=optimizer)

    def _pair(self, device: torch.device) -> Tuple[EmulatedStream, EmulatedStream]:
        pair = (EmulatedStream(self, device, "grad"), EmulatedStream(self, device, "copy"))
        self.streams.extend(pair)
        return pair

    def install(self, monkeypatch, optimizer: bool = True) -> "Emulation":
        import offload.memory.pool as pool_mod
        import offload.memory.region as region_mod
        from offload.optim import adam
        from offload.optim.flat_state import FlatState
        from offload.optim.shard_store import stage3_store

        monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False: self._copy(dst, src, non_blocking))
        monkeypatch.setattr(pool_mod, "cuda_pin_available", lambda: True)
        monkeypatch.setattr(region_mod, "_cudart", lambda: _FakeCudart())
        if not optimizer:
            return self
        monkeypatch.setattr(FlatState, "side_streams", staticmethod(self._pair))
        monkeypatch.setattr(FlatState, "copy_cpu_grads", True)
        monkeypatch.setattr(FlatState, "stage_cpu_params", True)
        monkeypatch.setattr(FlatState, "default_sub_group", 4096)  # several copies in flight per param

        def flat_store_always(opt, stage, process_group):  # fp32 "device" params take it too
            store = stage3_store(opt, stage, process_group)  # shards of offload.shard: the inner store is this one
            if store is not None:
                return store
            opt.stage = 0 if stage is None else stage
            self.on_device(p for g in opt.param_groups for p in g["params"])
            return opt._flat_store(opt.stage, process_group)

        monkeypatch.setattr(adam._AdamBase, "_make_store", flat_store_always)
        return self

    def __enter__(self) -> "Emulation":
        self._mode = _ComputeStream(self)
        self._mode.__enter__()
        self._saved = None
        if self.all_device:
            self._saved = torch.autograd.graph.saved_tensors_hooks(lambda t: t, self._unpack)
            self._saved.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            self._saved.__exit__(*exc)
        self._mode.__exit__(*exc)
        for s in self.streams:  # nothing left queued for a later test to run
            s.queue.clear()
