"""One unit's params of one dtype as a flat buffer, sharded over the ranks.

[Note: flat unit layout] The params are laid end to end in a flat buffer of ``world *
chunk`` elements (``chunk`` a multiple of 256, so that the 256-element blocks of compressed
optimizer states never straddle two ranks' shards; the tail is zero padding). Rank r keeps
elements ``[r * chunk, (r + 1) * chunk)`` as ``shard``, an ``nn.Parameter`` registered on the
unit module: what ``model.parameters()`` yields and what the optimizer steps. The original
names (``module.weight``) are plain tensors that require grad, views of the ``full``
buffer. The full buffer is its own private anonymous mapping whose pages are returned to
the system when the unit is released (``MADV_DONTNEED``) and come back as the gather writes
them, so the views stay the same objects (autograd saved them) while their memory comes and
goes. (FSDP2 resizes the storage to 0 bytes instead; a view of such a storage read outside
the forward, ``print(model.layer.weight)``, crashes the process: here it reads zeros.)
Writing the gathered bytes does not bump their version counter (the values are those
autograd saved).
[Note: one rank's full buffer is its shard] On the CPU with one rank the chunk is the
whole flat buffer, so ``full`` is the shard's own memory (``shard`` is an ``nn.Parameter``
over it, the views are views of it): nothing is gathered or copied. In RAM the unit's
params stay where they are (a release frees nothing); on NVMe (``offload_params="nvme"``)
acquiring the unit loads its area (the read the prefetch hint started) and releasing it
evicts it, so the pages are read straight into the memory the unit computes with: no
staging shard, no 2 x the unit in RAM, no copy (at 500M params in bf16 the copies were a
fifth of a forward + backward). While the unit is live its area is *held* (tier.py
``hold``): an eviction by someone else (the optimizer stepping, ``shard_values``) leaves its
pages in memory. They share one version counter, as a plain param and its views do: an
in-place op on the shard between a forward and its backward (a step there) makes the
backward raise torch's error, as it would without ``shard``.
[Note: the CUDA seam] Every transfer of a unit goes through two calls:
``FlatParam.gather_async`` (returns a handle; ``wait()`` before the unit's params are read)
and the reducer's ``_issue`` / ``_retire`` (grads.py; the shard grad is read after them).
For params on a CUDA device these, with ``alloc`` / ``free``, are the only places that
branch (``self.streams``): device.py [Note: stage 3 on a device] queues the gathers and the
reductions on side streams and keeps ``full`` on the device. The schedule (schedule.py) and
the hooks stay as they are. In CI, tests/stream_emulation.py's ``EmulatedStream`` stands for
the two streams (a unit read before its wait shows stale bytes: tests/test_shard_cuda.py),
as it does for the stage-2 streams.
"""
from __future__ import annotations

import mmap
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from offload.memory import HUGE_PAGE, paging
from offload.memory.region import Region
from offload.shard import device as device_mod
from offload.shard.callers import check_not_accelerate, check_not_gathered
from offload.shard.dcp_chunks import chunk_of, mark_chunk
from offload.shard.guards import refuse_copy
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

    def __init__(self, handle: Any, full: Optional[torch.Tensor], version: int, after: Any = None) -> None:
        self.handle, self.full, self.version, self.after = handle, full, version, after

    def wait(self) -> bool:
        done = self.handle.wait()
        if self.full is not None:
            device_mod.set_version(self.full, self.version)
        if self.after is not None:  # the paged shard was read: its pages may leave RAM now
            after, self.after = self.after, None
            after()
        return done


class _Ready:
    """The handle of a gather that had nothing to do (one rank, [Note: one rank's full
    buffer is its shard])."""

    def wait(self) -> bool:
        return True


class ShardInfo:
    """What a shard param carries (``p._offload_shard``): the optimizer's sign of stage 3."""

    def __init__(self, group: Any, world: int, rank: int, unit: str) -> None:
        self.group, self.world, self.rank, self.unit = group, world, rank, unit
        self.runtime: Any = None  # the ShardRuntime (offload/shard/hooks.py), set by shard()
        self.flat: Any = None  # the FlatParam whose shard this is

    # deepcopy / pickle of a shard: guards.py [Note: calls on a sharded model]
    __reduce_ex__ = refuse_copy

    def __repr__(self) -> str:
        return f"ShardInfo(unit={self.unit!r}, world={self.world}, rank={self.rank})"


class FlatParam:
    """The flat buffer, the shard and the views of one unit's params of one dtype."""

    __reduce_ex__ = refuse_copy  # guards.py [Note: calls on a sharded model]
    _loading = False  # between load_state_dict's hooks (_load_hook)
    # [Note: a param without a grad] in offload/optim/shard_store.py: per param, whether any rank
    # had a grad for it, agreed at the last backward (``grads_taken``: this rank's, since the last
    # step; ``warned_no_grad``: the names warned about)
    grads_anywhere: Optional[List[bool]] = None

    def __init__(self, members: List[Tuple[nn.Parameter, List[Tuple[nn.Module, str]]]], *,
                 info: ShardInfo, holder: nn.Module, attr: str, names: List[str], tier: Any = None,
                 streams: Any = None, host_shard: bool = False) -> None:
        self.dtype = members[0][0].dtype
        self.world, self.rank = info.world, info.rank
        self.names = names  # the params' qualified names in the module before shard()
        self.shapes = [p.shape for p, _ in members]
        total = sum(p.numel() for p, _ in members)
        self.chunk = chunk_for(total, self.world)
        self.padded = self.world * self.chunk
        device = members[0][0].device
        self.streams = streams  # the device path's side streams (device.py), None on the CPU
        self.host_shard = streams is not None and host_shard  # the device path: the shard in host memory
        if device.type != "cpu" and streams is None:
            raise NotImplementedError(f"offload.shard: params on {device} (CPU and CUDA params only)")
        self._itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self._live = True
        # [Note: one rank's full buffer is its shard] on the CPU with one rank
        self._alias = streams is None and self.world == 1
        self.where = f"{info.unit + '.' if info.unit else ''}{attr}"  # the shard's name in model.named_parameters()
        with torch.no_grad():
            if self._alias:
                self.full = (tier.area(self.chunk, self.dtype, name=self._label()) if tier is not None
                             else torch.zeros(self.chunk, dtype=self.dtype))
                if tier is not None:
                    paging.will_write([self.full])
            elif streams is None:
                # huge pages: a 56 MB unit gathered into dropped 4 KiB pages took 49 ms here, into huge
                # pages 14 (a unit under one huge page keeps 4 KiB pages: a huge one would be all resident)
                nbytes = max(1, self.padded * self._itemsize)
                self._region = Region(nbytes, huge=nbytes >= HUGE_PAGE, prefault=False)
                self.full = torch.frombuffer(self._region.view(0, self.padded * self._itemsize), dtype=self.dtype,
                                             count=self.padded)
            else:  # [Note: stage 3 on a device] in device.py: a storage resized as units come and go
                self.full = torch.zeros(self.padded, dtype=self.dtype, device=device)
            self.slots: List[Tuple[int, int]] = []
            off = 0
            for p, _ in members:
                n = p.numel()
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                self.slots.append((off, n))
                off += n
            lo = self.rank * self.chunk
            self.tier = tier
            self.grad_area: Optional[torch.Tensor] = None
            if self._alias:
                if tier is not None:
                    paging.store([self.full])
                self.shard = nn.Parameter(self.full)
                self.full = self.full.detach()  # the leaves' base: not the Parameter itself
            elif tier is None and streams is not None and host_shard:  # offload_params="cpu" on a device
                host = device_mod.host_buffer(self.chunk, self.dtype, device)
                self.shard = nn.Parameter(host.copy_(self.full[lo:lo + self.chunk]))
            elif tier is None:
                self.shard = nn.Parameter(self.full[lo:lo + self.chunk].clone())
            else:  # [Note: the param tier] in tier.py: the chunk and its grad in the swap file
                area = tier.area(self.chunk, self.dtype, name=self._label())
                paging.will_write([area])
                area.copy_(self.full[lo:lo + self.chunk])
                paging.store([area])
                paging.evict([area])
                self.shard = nn.Parameter(area)
        self.shard._offload_shard = info  # type: ignore[attr-defined]
        info.flat = self
        holder.register_parameter(attr, self.shard)
        holder._register_state_dict_hook(self._state_dict_hook)  # a DCP chunk ([Note: shards in DCP])
        if tier is not None:  # load_state_dict() writes the values on disk
            holder._register_load_state_dict_pre_hook(self._load_hook)
            holder.register_load_state_dict_post_hook(self._loaded_hook)
        self._attr = attr
        self.shard_ptr = self.shard.data_ptr()  # checked at each forward (hooks.py _check_shards)
        self.leaves: List[torch.Tensor] = []
        for (p, owners), (o, n) in zip(members, self.slots):
            leaf = self.full[o:o + n].view(p.shape).detach().requires_grad_(True)
            self.leaves.append(leaf)
            for m, name in owners:
                del m._parameters[name]
                setattr(m, name, leaf)  # a plain attribute now (see the note)
        self.grads_taken, self.warned_no_grad = [False] * len(self.leaves), set()  # see grads_anywhere
        self.free()

    def _label(self) -> str:
        """The shard in errors ([Note: writes past the pager] in tier_writes.py)."""
        more = ", ..." if len(self.names) > 3 else ""
        return f"the shard param {self.where!r} (of {', '.join(self.names[:3])}{more})"

    # ------------------------------------------------------------------ storage
    @property
    def nbytes(self) -> int:
        return self.padded * self._itemsize

    def allocated(self) -> bool:
        return self._live

    def alloc(self) -> None:
        if self._alias and self.tier is not None:
            paging.load([self.full])  # from the swap file (a prefetch may have started it)
            self.tier.hold(self.full, True)
        if self.streams is not None:
            device_mod.alloc_full(self)
        self._live = True  # the pages come back as the gather writes them

    def free(self) -> None:
        """The full buffer's pages back to the system (see the note): reads show zeros."""
        if self.streams is not None:
            device_mod.free_full(self)  # the device buffer's storage to 0 bytes
        elif self._alias:
            if self.tier is not None:
                self.tier.hold(self.full, False)
                paging.evict([self.full])  # unchanged since loaded: its pages are dropped, nothing written
        else:
            self._region._mmap.madvise(mmap.MADV_DONTNEED, self._region.skip, self._region.size)
        self._live = False

    def gather_async(self, group: Any, scratch: bool = False):
        """Start the all-gather of the shards into ``full`` (or, ``scratch``, into a buffer
        thrown away: a collective every rank must issue that this rank does not need).
        Returns (handle, buffer kept alive until the handle is waited)."""
        if self.streams is not None:
            return device_mod.gather(self, group, scratch)  # on side streams: [Note: stage 3 on a device]
        if self._alias:  # one rank: nothing to gather, the shard is the full buffer (see the note)
            if not scratch:
                self.alloc()
            return _Ready(), None
        src = self.shard.detach()
        after = None
        if self.tier is not None:
            paging.load([src])  # from the swap file (a prefetch may have started it: prefetch_shard)
            after = lambda: paging.evict([src])  # noqa: E731
        if scratch:
            out = torch.empty(self.padded, dtype=self.dtype, device=src.device)
            return _Kept(comm.all_gather_async(out, src, group), None, 0, after), out
        self.alloc()
        version = self.full._version
        with torch.no_grad():
            return _Kept(comm.all_gather_async(self.full, src, group), self.full, version, after), None

    def prefetch_shard(self) -> None:
        """A hint (offload_params="nvme"): start reading the shard from disk now."""
        if self.tier is not None:
            paging.prefetch([self.shard.detach()])

    # ------------------------------------------------------------------ the shard's values
    def shard_values(self) -> torch.Tensor:
        """A new tensor with this rank's chunk (``chunk`` elements, the params' dtype), from
        wherever the shard lives (host memory, or its swap file with offload_params="nvme").
        What checkpoints and ``full_state_dict`` read; never a view of the live shard."""
        src = self.shard.detach()
        paging.load([src])
        try:
            return src.clone()
        finally:
            paging.evict([src])

    def _state_dict_hook(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        """The shard in ``module.state_dict()`` as this rank's chunk for DCP ([Note: shards in
        DCP] in dcp_chunks.py): with params on NVMe, the values on disk."""
        key = prefix + self._attr
        value = state_dict.get(key)
        if self.tier is not None and key in state_dict:
            value = self.shard_values()
        elif not isinstance(value, torch.Tensor) or value is self.shard:
            return  # keep_vars=True: the Parameter itself, unmarked
        check_not_gathered(self.world)  # [Note: DCP's full_state_dict on shards] (callers.py)
        check_not_accelerate()  # [Note: accelerate's get_state_dict on shards]
        state_dict[key] = mark_chunk(value, *chunk_of(self))

    def _load_hook(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """torch's own copy of the dict's value into the shard follows: its pages in RAM for it
        (the bytes on disk: a copy that does not happen stores them again), stored after it
        (``_loaded_hook``). Written past the pager, the copy was lost (tier_writes.py)."""
        value = state_dict.get(prefix + self._attr)
        if isinstance(value, torch.Tensor) and value.numel() == self.chunk:
            paging.load([self.shard.detach()])
            self._loading = True

    def _loaded_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self._loading:
            self._loading = False
            dst = self.shard.detach()
            paging.store([dst])
            paging.evict([dst])

    def set_shard_values(self, values: torch.Tensor) -> None:
        """This rank's chunk <- ``values`` (``chunk`` elements; cast to the params' dtype),
        wherever the shard lives. What checkpoint loading and streamed weights write."""
        if values.numel() != self.chunk:
            raise ValueError(f"{self.chunk} elements expected for the shard of {self.names[:3]}, got {values.numel()}")
        dst = self.shard.detach()
        with torch.no_grad():
            paging.will_write([dst])
            dst.copy_(values.reshape(-1))
            paging.store([dst])
            paging.evict([dst])

    # ------------------------------------------------------------------ grads
    def has_grads(self) -> bool:
        return any(leaf.grad is not None for leaf in self.leaves)

    def drop_grads(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None

    def open_shard_grad(self, whole: bool = False) -> bool:
        """Before a reduction lands in ``shard.grad``: True when there is none (its slices are
        then copied, not added: the bits of the average itself, -0.0 included); made now
        (zeros) unless ``whole`` (one reduction of the whole chunk, which becomes the grad)."""
        if self.grad_area is not None and (self.shard.grad is None or self.shard.grad is self.grad_standin):
            return self._open_grad_on_disk()
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
        if self.streams is not None and avg.device != self.shard.device:
            avg = avg.to(self.shard.device)  # the device path: to (or from) the host shard
        if self.grad_area is not None and self.shard.grad is self.grad_standin:
            self._add_grad_on_disk(avg, lo, fresh)
            return
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

    # ------------------------------------------------------------------ grads on disk
    # [Note: grads on disk] When the optimizer keeps its states on NVMe (offload="nvme"), the
    # shard grads live there too: in a swap file (``grad_area``, paged: offload/shard/tier.py,
    # the params' file when they are on NVMe too); ``shard.grad`` is then ``grad_standin``: a tensor of the right
    # shape over one zero element (stride 0), so that torch's rules keep working: zero_grad()
    # drops it (None: the next grad is written afresh), zero_grad(set_to_none=False) zeroes it
    # in place (its version moves: the grad on disk is zeroed), and any other in-place use
    # (clip_grad_norm_'s multiply, GradScaler.unscale_) raises torch's error about a tensor
    # whose elements share memory. The optimizer reads the real grad through
    # ``disk_grad(p.grad)`` (offload/optim/shard_store.py); clip with ``max_grad_norm=``.
    def place_grads(self, tier: Any) -> None:
        """The shard's grads go to ``tier``'s file from now on (the optimizer's states are on
        NVMe: the grads live where the states do)."""
        if self.grad_area is not None:
            return
        self.grad_area = tier.area(self.chunk, self.dtype, "grads", name=f"the grad on disk of {self.where!r}")
        # p.grad of the shard while its grad is in the swap file
        self.grad_standin = torch.zeros(1, dtype=self.dtype).expand(self.chunk)
        self._standin_version = self.grad_standin._version

    def _open_grad_on_disk(self) -> bool:
        """open_shard_grad for a grad on disk: True (fresh: slices copied) when there is none."""
        if self.shard.grad is None:
            self.shard.grad = self.grad_standin
            self._standin_version = self.grad_standin._version
            return True
        self.disk_grad()  # zeroed on disk first when the stand-in was zeroed in place
        return False

    def _add_grad_on_disk(self, avg: torch.Tensor, lo: int, fresh: bool) -> None:
        g = self.grad_area[lo:lo + avg.numel()]
        if fresh:
            paging.will_write([g])
            g.copy_(avg)
        else:
            paging.load([g])
            g.add_(avg)
        paging.store([g])
        paging.evict([g])

    def put_grads(self, grads: List[Tuple[torch.Tensor, int, int]]) -> None:
        """One rank ([Note: one rank's grads] in grads.py): the views' grads ``(grad, offset,
        numel)`` are the shard grad: copied in (zeros where a view has none, and over the
        padding), or added to the one there (accumulation)."""
        fresh = self.open_shard_grad(whole=True)
        on_disk = self.grad_area is not None and self.shard.grad is self.grad_standin
        if on_disk:
            dst = self.grad_area
            (paging.will_write if fresh else paging.load)([dst])
        elif self.shard.grad is None:
            dst = self.shard.grad = torch.empty(self.chunk, dtype=self.dtype)
        else:
            dst = self.shard.grad
        with torch.no_grad():
            end = 0
            for g, o, n in sorted(grads, key=lambda x: x[1]):
                if fresh:
                    dst[end:o].zero_()
                    dst[o:o + n].copy_(g)
                else:
                    dst[o:o + n].add_(g)
                end = o + n
            if fresh:
                dst[end:].zero_()
        if on_disk:
            paging.store([dst])
            paging.evict([dst])

    def _standin_zeroed(self) -> bool:
        return self.grad_standin._version != self._standin_version

    def disk_grad(self) -> Optional[torch.Tensor]:
        """The paged grad the optimizer steps with when ``shard.grad`` is the stand-in (zeroed
        on disk first when zero_grad(set_to_none=False) zeroed the stand-in); else None."""
        if self.grad_area is None or self.shard.grad is not self.grad_standin:
            return None
        if self._standin_zeroed():
            g = self.grad_area
            paging.will_write([g])
            g.zero_()
            paging.store([g])
            paging.evict([g])
            self._standin_version = self.grad_standin._version
        return self.grad_area

class Unit:
    """A fetch unit: its module and its flat params (one per dtype)."""

    def __init__(self, index: int, module: nn.Module, name: str, flats: List[FlatParam]) -> None:
        self.index, self.module, self.name, self.flats = index, module, name, flats
        self.is_root = index == 0
        self.live = False  # gathered for use (schedule.py)
        self.uses = 0      # forward uses whose backward has not run yet

    def gather(self, group: Any, scratch: bool = False):
        return [flat.gather_async(group, scratch) for flat in self.flats]

    def free(self) -> None:
        for flat in self.flats:
            flat.free()

    def prefetch_shards(self) -> None:
        for flat in self.flats:
            flat.prefetch_shard()

    def live_bytes(self) -> int:
        return sum(flat.nbytes for flat in self.flats if flat.allocated())

    def has_grads(self) -> bool:
        return any(flat.has_grads() for flat in self.flats)

    def drop_grads(self) -> None:
        for flat in self.flats:
            flat.drop_grads()

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name or '<root>'}, {[f.padded for f in self.flats]})"
