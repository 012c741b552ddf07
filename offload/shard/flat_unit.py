"""One unit's params of one dtype as a flat buffer, sharded over the ranks.

[Note: flat unit layout] The params are laid end to end in a flat buffer of ``world *
chunk`` elements (``chunk`` a multiple of 256, so that the 256-element blocks of compressed
optimizer states never straddle two ranks' shards; the tail is zero padding). Rank r keeps
elements ``[r * chunk, (r + 1) * chunk)`` as ``shard``, an ``nn.Parameter`` registered on the
unit module: what ``model.parameters()`` yields and what the optimizer steps. The original
names (``module.weight``) are plain tensors that require grad, views of the ``full``
buffer; the full buffer's storage is resized to 0 bytes when released and back when
gathered (as FSDP2 does), so the views stay the same objects (autograd saved them) while
their memory comes and goes. Writing the gathered bytes does not bump their version
counter (the values are those autograd saved).
[Note: the CUDA seam, not built yet] Every transfer of a unit goes through two calls:
``FlatParam.gather_async`` (returns a handle; ``wait()`` before the unit's params are read)
and the reducer's ``_reduce`` (grads.py; the shard grad is read after ``wait()``). On CUDA
these are the only places that change: ``gather_async`` queues, on an all-gather side stream
(``offload.zero.streams.SideStream``, after ``wait_current()``), the host-to-device copy of
the shard (``offload_params="cpu"``: a pinned host shard) and the NCCL all-gather into the
device ``full`` buffer, and records an event; ``wait()`` makes the compute stream wait on that
event (not the host); ``free()`` must then ``record_stream`` the buffer on the compute stream
before resizing it. The reduce side queues the flatten + reduce-scatter on a reduce stream
after the grads' producing stream, and the device-to-host copy of the shard grad. The
schedule (schedule.py) and the hooks stay as they are. In CI, tests/stream_emulation.py's
``EmulatedStream`` would stand for the two streams (a unit read before its wait shows stale
bytes), as it does for the stage-2 streams.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch
import torch.nn as nn

from offload.zero import comm

__all__ = ["BLOCK", "ShardInfo", "FlatParam", "chunk_for"]

BLOCK = 256
"""The chunk granule: offload/kernels/quant.py's block of compressed states."""


def chunk_for(total: int, world: int) -> int:
    """Elements per rank: ceil(total / world) rounded up to a multiple of BLOCK."""
    per = -(-total // world)
    return max(BLOCK, -(-per // BLOCK) * BLOCK)


class _Kept:
    """A gather's handle whose wait puts back the views' version counter as it was when the
    gather was issued (see the note): gloo's worker thread counts its write into the
    output when the collective completes, at a time no context manager can bracket."""

    def __init__(self, handle: Any, full: torch.Tensor, version: int) -> None:
        self.handle, self.full, self.version = handle, full, version

    def wait(self) -> bool:
        done = self.handle.wait()
        torch._C._autograd._unsafe_set_version_counter((self.full,), (self.version,))
        return done


class ShardInfo:
    """What a shard param carries (``p._offload_shard``): the optimizer's sign of stage 3."""

    def __init__(self, group: Any, world: int, rank: int, unit: str) -> None:
        self.group, self.world, self.rank, self.unit = group, world, rank, unit
        self.runtime: Any = None  # the ShardRuntime (offload/shard/hooks.py), set by shard()

    def __repr__(self) -> str:
        return f"ShardInfo(unit={self.unit!r}, world={self.world}, rank={self.rank})"


class FlatParam:
    """The flat buffer, the shard and the views of one unit's params of one dtype."""

    def __init__(self, members: List[Tuple[nn.Parameter, List[Tuple[nn.Module, str]]]], *,
                 info: ShardInfo, holder: nn.Module, attr: str, names: List[str]) -> None:
        self.dtype = members[0][0].dtype
        self.world, self.rank = info.world, info.rank
        self.names = names  # the params' qualified names in the module before shard()
        self.shapes = [p.shape for p, _ in members]
        total = sum(p.numel() for p, _ in members)
        self.chunk = chunk_for(total, self.world)
        self.padded = self.world * self.chunk
        device = members[0][0].device
        with torch.no_grad():
            self.full = torch.zeros(self.padded, dtype=self.dtype, device=device)
            self.slots: List[Tuple[int, int]] = []
            off = 0
            for p, _ in members:
                n = p.numel()
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                self.slots.append((off, n))
                off += n
            lo = self.rank * self.chunk
            self.shard = nn.Parameter(self.full[lo:lo + self.chunk].clone())
        self.shard._offload_shard = info  # type: ignore[attr-defined]
        holder.register_parameter(attr, self.shard)
        self.leaves: List[torch.Tensor] = []
        for (p, owners), (o, n) in zip(members, self.slots):
            leaf = self.full[o:o + n].view(p.shape).detach().requires_grad_(True)
            self.leaves.append(leaf)
            for m, name in owners:
                del m._parameters[name]
                setattr(m, name, leaf)  # a plain attribute now (see the note)
        self._itemsize = self.full.element_size()
        self.free()

    # ------------------------------------------------------------------ storage
    @property
    def nbytes(self) -> int:
        return self.padded * self._itemsize

    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def alloc(self) -> None:
        if not self.allocated():
            self.full.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def gather_async(self, group: Any, scratch: bool = False):
        """Start the all-gather of the shards into ``full`` (or, ``scratch``, into a buffer
        thrown away: a collective every rank must issue that this rank does not need).
        Returns (handle, buffer kept alive until the handle is waited)."""
        src = self.shard.detach()
        if scratch:
            out = torch.empty(self.padded, dtype=self.dtype, device=src.device)
            return comm.all_gather_async(out, src, group), out
        self.alloc()
        version = self.full._version
        with torch.no_grad():
            return _Kept(comm.all_gather_async(self.full, src, group), self.full, version), None

    # ------------------------------------------------------------------ the shard's values
    def shard_values(self) -> torch.Tensor:
        """A new tensor with this rank's chunk (``chunk`` elements, the params' dtype), from
        wherever the shard lives (host memory, or its swap file with offload_params="nvme").
        What checkpoints and ``full_state_dict`` read; never a view of the live shard."""
        return self.shard.detach().clone()

    def set_shard_values(self, values: torch.Tensor) -> None:
        """This rank's chunk <- ``values`` (``chunk`` elements; cast to the params' dtype),
        wherever the shard lives. What checkpoint loading and streamed weights write."""
        if values.numel() != self.chunk:
            raise ValueError(f"{self.chunk} elements expected for the shard of {self.names[:3]}, got {values.numel()}")
        with torch.no_grad():
            self.shard.detach().copy_(values.reshape(-1))

    # ------------------------------------------------------------------ grads
    def has_grads(self) -> bool:
        return any(leaf.grad is not None for leaf in self.leaves)

    def open_shard_grad(self, whole: bool = False) -> bool:
        """Before a reduction lands in ``shard.grad``: True when there is none (its slices are
        then copied, not added: the bits of the average itself, -0.0 included); made now
        (zeros) unless ``whole`` (one reduction of the whole chunk, which becomes the grad)."""
        if self.shard.grad is not None:
            return False
        if not whole:
            self.shard.grad = torch.zeros(self.chunk, dtype=self.dtype, device=self.shard.device)
        return True

    def add_shard_grad(self, summed: torch.Tensor, lo: int = 0, fresh: bool = False) -> None:
        """The reduced sum of this rank's chunk elements ``[lo, lo + summed.numel())``:
        averaged over ranks into that slice of ``shard.grad`` (copied when ``fresh``,
        added otherwise: accumulation)."""
        avg = summed.mul_(1.0 / self.world).to(self.dtype)  # as DDP and the stage-2 path scale the sum
        if self.shard.grad is None and lo == 0 and avg.numel() == self.chunk:
            self.shard.grad = avg
            return
        if self.shard.grad is None:
            fresh = self.open_shard_grad()
        dst = self.shard.grad[lo:lo + avg.numel()]
        if fresh:
            dst.copy_(avg)
        else:
            dst.add_(avg)


class Unit:
    """A fetch unit: its module and its flat params (one per dtype)."""

    def __init__(self, index: int, module: nn.Module, name: str, flats: List[FlatParam]) -> None:
        self.index, self.module, self.name, self.flats = index, module, name, flats
        self.is_root = index == 0
        self.live = False  # gathered for use (schedule.py)
        self.uses = 0      # forward uses whose backward has not run yet
        self.reduced = False

    def gather(self, group: Any, scratch: bool = False):
        return [flat.gather_async(group, scratch) for flat in self.flats]

    def free(self) -> None:
        for flat in self.flats:
            flat.free()

    def live_bytes(self) -> int:
        return sum(flat.nbytes for flat in self.flats if flat.allocated())

    def has_grads(self) -> bool:
        return any(flat.has_grads() for flat in self.flats)

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name or '<root>'}, {[f.padded for f in self.flats]})"
