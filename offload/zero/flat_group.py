"""One flat group: params of one device and dtype, this rank's shard of their fp32 states.

See [Note: flat layout] in ``partition.py`` for the arithmetic. A ``FlatGroup`` owns the
host buffers of its shard (from the memory layer's pools: pageable, or pinned where a DMA
engine reads or writes them) and does the group's side of the collectives: bucketed
reduction of the grads into the shard and the all-gather of the updated params. It knows
no optimizer math; the optimizer's flat store (``offload/optim/flat/``) drives it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.kernels.fields import ADAM, MASTER, Rule, StateField, fields_bytes
from offload.kernels.quant import BLOCK, PACKED_BLOCK, zero_code
from offload.memory import BufferPool, paging
from offload.zero import comm
from offload.zero.partition import FlatLayout, split_ranges

__all__ = ["FlatGroup", "LOWP", "STATES", "fill_zero_state"]

LOWP = (torch.float16, torch.bfloat16)
STATES = ADAM.with_master()
"""What an Adam flat group keeps per element of its shard: the fp32 master and the moments
(a group of another rule: ``rule.with_master()``, its ``fields``)."""


def fill_zero_state(field: StateField, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a state stored as ``field``) <- zeros in that storage: for packed int8 blocks,
    the zero code and absmax 0 (what encoding zeros gives; all-zero bytes would decode to
    -0.0 in the signed map)."""
    if not field.blocked:
        return t.zero_()
    blocks = t.view(-1, PACKED_BLOCK)
    blocks[:, :BLOCK].fill_(zero_code(field.signed))
    blocks[:, BLOCK:].zero_()
    return t


class FlatGroup:
    """The params of one (device, dtype), this rank's shard of their states, and buffers.

    ``rule``'s fields say how each state is stored (fp32, bf16, packed int8 blocks: the
    buffers hold ``field.storage_numel`` elements of ``field.storage_dtype``; a blocked field
    makes the layout block-aligned, [Note: block-aligned flat layout] in partition.py).
    ``master_lowp``: the bf16 params are their own master ([Note: bf16 master]): no MASTER."""

    def __init__(self, params: List[torch.Tensor], *, world: int, rank: int, pools: Tuple[BufferPool, BufferPool],
                 comm_dev: torch.device, bucket_numel: int, need_host_grad: bool, stage_cpu: bool = False,
                 swapped: bool = False, rule: Rule = ADAM, master_lowp: bool = False) -> None:
        self.params = params
        self.rule = rule
        self.master_lowp = master_lowp
        self.fields: Tuple[StateField, ...] = rule.fields if master_lowp else rule.with_master()
        self.compressed = master_lowp or rule != rule.base
        """Whether a step goes through the kernels' compressed path (rounding seed and offset)."""
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.lowp = self.dtype in LOWP
        if master_lowp and self.dtype != torch.bfloat16:
            raise ValueError(f"master_dtype='bfloat16' keeps no float32 master: it needs bfloat16 params, "
                             f"got {self.dtype} params")
        align = BLOCK if any(f.blocked for f in rule.fields) else 1
        self.layout = FlatLayout([p.numel() for p in params], world, rank, align)
        self.world, self.rank = world, rank
        # (pageable, pinned): only what a DMA engine reads or writes is pinned (grad copies,
        # staging, an fp32 master that is copied to the device); moments never leave the host.
        self._pools = pools
        dma = self.device.type == "cuda" or stage_cpu  # stage_cpu: CPU params sent as CUDA ones (tests)
        self._bufs = []
        S = self.layout.shard
        # swapped: master and moments live in NVMe swap files (offload/optim/swapped_shards.py)
        self.swapped = swapped
        self.stage = None  # below; refresh_master reads it
        self.master = None if swapped or master_lowp else \
            self._tensor(MASTER.dtype, S, pinned=dma and not self.lowp)
        # the rule's states, each an attribute of its name (fg.exp_avg, fg.momentum_buffer, ...),
        # in their storage (bf16 elements, or the bytes of packed int8 blocks)
        for f in rule.fields:
            setattr(self, f.name, None if swapped else
                    fill_zero_state(f, self._tensor(f.storage_dtype, f.storage_numel(S))))
        self.refresh_master()
        # Destination of grad copies (one rank, hook path): the whole flat range, own dtype.
        self.host_grad = self._tensor(self.dtype, self.layout.total, pinned=dma) if need_host_grad else None
        # Staging of updated low-precision params on their way to the device (one rank, CUDA).
        if world == 1 and dma and self.lowp:
            self.stage = self._tensor(self.dtype, S, pinned=dma)
            if master_lowp:  # the stage is the master: [Note: bf16 master]
                self.refresh_master()
        self.gshard = self.lowp_shard = None
        self.send = self.gather = self.rs_out = None
        if world > 1:
            self.gshard = self._tensor(torch.float32, S)  # fp32 sum of the grads of this shard
            if self.lowp:
                self.lowp_shard = self._tensor(self.dtype, S)
                self.refresh_lowp_shard()
            # One bucket moves `chunk` elements of every rank's shard: a send buffer of
            # world * chunk fp32 for grads and one of the param dtype for the all-gather.
            # (whole blocks: a bucket is a segment of the step, cut where a block may be cut)
            self.chunk = max(align, min(S, bucket_numel // world) // align * align)
            self.send = torch.empty(world * self.chunk, dtype=torch.float32, device=comm_dev)
            self.gather = torch.empty(world * self.chunk, dtype=self.dtype, device=comm_dev)
            self.rs_out = torch.empty(self.chunk, dtype=torch.float32, device=comm_dev)
            self.slots: List[torch.Tensor] = []  # send buffers of buckets in flight (reduce in backward)
            self.slot_out: List[torch.Tensor] = []
            self.comm_dev = comm_dev
        # Hook path bookkeeping: per param, (weakref to the grad copied, its _version, its sum
        # of squares taken on the device or None).
        self.grad_tag: List[Optional[Tuple[Any, int, Any]]] = [None] * len(params)

    def _tensor(self, dtype: torch.dtype, numel: int, pinned: bool = False) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        size = torch.empty(0, dtype=dtype).element_size()
        pool = self._pools[1] if pinned else self._pools[0]
        buf = pool.acquire(numel * size)
        self._bufs.append((pool, buf))
        return buf.tensor(dtype, numel)

    # -- views ------------------------------------------------------------------------------
    def state(self, name: str) -> Optional[torch.Tensor]:
        """The shard's buffer of field ``name`` (``master`` or one of the rule's; None when swapped)."""
        if name not in self.names:
            raise KeyError(f"a flat group of rule {self.rule.name!r} keeps {[f.name for f in self.fields]}, "
                           f"not {name!r}")
        return getattr(self, name)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> StateField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"a flat group of rule {self.rule.name!r} keeps {list(self.names)}, not {name!r}")

    def state_range(self, name: str, a: int, b: int) -> torch.Tensor:
        """The storage of field ``name`` for shard-local elements [a, b) (``a`` on a block
        boundary for a blocked field: ``StateField.storage_offset`` refuses it otherwise)."""
        f = self.field(name)
        lo = f.storage_offset(a)
        return getattr(self, name)[lo:lo + f.storage_numel(b - a)]

    def flat_param(self, i: int) -> torch.Tensor:
        """The param's data as a 1-D view (params on CUDA must be contiguous: checked earlier)."""
        return self.params[i].detach().view(-1) if self.params[i].is_contiguous() else None

    def refresh_master(self) -> None:
        """master <- the params' current values (at start, and after a load without masters);
        with a bf16 master, the staging buffer that holds it for device params."""
        master = self.stage if self.master_lowp else self.master
        if master is not None:
            master.zero_()
            self.shard_values(0, self.layout.shard, master)

    def shard_values(self, a: int, b: int, out: torch.Tensor) -> None:
        """out <- the params' current values at shard-local [a, b) (upcast; padding untouched)."""
        start = self.layout.shard_range()[0]
        for pc in self.layout.pieces(start + a, start + b):
            src = self.params[pc.index].detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel]
            paging.load([src])  # params on NVMe: [Note: paged tensors] in offload/memory/paging.py
            out[pc.lo - start - a:pc.hi - start - a].copy_(src)
            paging.evict([src])

    def refresh_lowp_shard(self) -> None:
        """lowp_shard <- the master (rounded), or the params' values when the master is swapped."""
        if self.lowp_shard is None:
            return
        if self.master is not None:
            self.lowp_shard.copy_(self.master)
        else:
            self.lowp_shard.zero_()
            self.shard_values(0, self.layout.shard, self.lowp_shard)

    def nbytes(self) -> Dict[str, int]:
        out = {"states": 0 if self.swapped else fields_bytes(self.fields, self.layout.shard)}
        out["grads"] = 0
        for t in (self.host_grad, self.gshard):
            if t is not None:
                out["grads"] += t.numel() * t.element_size()
        out["lowp"] = sum(t.numel() * t.element_size() for t in (self.stage, self.lowp_shard) if t is not None)
        comm_bufs = [self.send, self.gather, self.rs_out] + list(getattr(self, "slots", [])) + \
            list(getattr(self, "slot_out", []))
        out["comm"] = sum(t.numel() * t.element_size() for t in comm_bufs if t is not None)
        return out

    def close(self) -> None:
        for name in ("master",) + self.rule.names + ("host_grad", "stage", "gshard", "lowp_shard",
                                                     "send", "gather", "rs_out"):
            setattr(self, name, None)
        self.slots, self.slot_out = [], []
        for pool, buf in self._bufs:
            pool.release(buf)
        self._bufs = []

    # -- collectives ------------------------------------------------------------------------
    def fill_grads(self, dst: torch.Tensor, lo: int) -> None:
        """dst <- the local grads of flat [lo, lo + len(dst)), upcast, zeros elsewhere."""
        done = 0  # dst[:done] is written; gaps (padding, params without grad) get zeros
        for pc in self.layout.pieces(lo, lo + dst.numel()):
            g = self.params[pc.index].grad
            if g is None:
                continue
            if pc.lo - lo > done:
                dst[done:pc.lo - lo].zero_()
            src = g.detach().reshape(-1)[pc.param_offset:pc.param_offset + pc.numel]
            dst[pc.lo - lo:pc.hi - lo].copy_(src)
            done = pc.hi - lo
        if done < dst.numel():
            dst[done:].zero_()

    def reduce_grads(self, group: Any, stage: int, only_slice: bool) -> None:
        """gshard <- the sum over ranks of the grads of this rank's shard, bucket by bucket.

        Each bucket gathers the N slices of the flat range that go to the N ranks into one
        fp32 send buffer (upcasting on the way), then reduce-scatters it (stage 2) or
        all-reduces it and keeps this rank's slice (stage 1). ``only_slice``: the grads are
        already averaged (DDP): copy this rank's slice, no communication.
        """
        S, c, W = self.layout.shard, self.chunk, self.world
        start = self.layout.shard_range()[0]
        for a, b in split_ranges(0, S, c):
            n = b - a
            if only_slice:
                self.fill_grads(self.send[:n], start + a)
                self.gshard[a:b].copy_(self.send[:n])
                continue
            send = self.send[:W * n]
            for r in range(W):
                self.fill_grads(send[r * n:(r + 1) * n], r * S + a)
            if stage == 2:
                # Straight into the host shard when the collective runs on the host.
                out = self.gshard[a:b] if send.device.type == "cpu" else self.rs_out[:n]
                comm.reduce_scatter(out, send, group)
            else:
                comm.all_reduce(send, group)
                out = send[self.rank * n:(self.rank + 1) * n]
            if out.data_ptr() != self.gshard[a:b].data_ptr():
                self.gshard[a:b].copy_(out)

    # -- reduction during backward (opt-in, see [Note: reduce in backward]) ---------------
    def bucket_ranges(self) -> List[Tuple[int, int]]:
        """Shard-local [a, b) of each bucket (the same on every rank)."""
        return split_ranges(0, self.layout.shard, self.chunk)

    def bucket_members(self) -> List[List[int]]:
        """Per bucket, the params with a part in it on any rank."""
        S = self.layout.shard
        out = []
        for a, b in self.bucket_ranges():
            idx = set()
            for r in range(self.world):
                idx.update(pc.index for pc in self.layout.pieces(r * S + a, r * S + b))
            out.append(sorted(idx))
        return out

    def launch_bucket(self, k: int, slot: int, group: Any, stage: int):
        """Fill send slot ``slot`` with bucket ``k`` and start its collective (async).

        Returns (work, finish): ``work.wait()`` then ``finish()`` puts the sum in gshard.
        """
        a, b = self.bucket_ranges()[k]
        n, W, S = b - a, self.world, self.layout.shard
        send = self.slots[slot][:W * n]
        for r in range(W):
            self.fill_grads(send[r * n:(r + 1) * n], r * S + a)
        if stage == 2:
            out = self.gshard[a:b] if send.device.type == "cpu" else self.slot_out[slot][:n]
            work = comm.reduce_scatter_async(out, send, group)
        else:
            out = send[self.rank * n:(self.rank + 1) * n]
            work = comm.all_reduce_async(send, group)

        def finish() -> None:
            if out.data_ptr() != self.gshard[a:b].data_ptr():
                self.gshard[a:b].copy_(out)
        return work, finish

    # -- release_grads: contiguous buckets, each summed into the rank that owns it -----------
    def owned_ranges(self) -> List[Tuple[int, int]]:
        """Flat [lo, hi) of each bucket of ``release_grads`` ([Note: releasing grads] in
        offload/optim/flat/grads.py): contiguous, as backward makes the grads, so that a bucket
        is complete (and its grads can be freed) once backward has passed it; ``world x chunk``
        elements each, the size of a send slot."""
        return split_ranges(0, self.world * self.layout.shard, self.world * self.chunk)

    def owned_members(self) -> List[List[int]]:
        """Per ``owned_ranges`` bucket, the params with a part in it."""
        return [sorted({pc.index for pc in self.layout.pieces(lo, hi)}) for lo, hi in self.owned_ranges()]

    def launch_owned(self, k: int, slot: int, group: Any, accumulate: bool):
        """Fill send slot ``slot`` with bucket ``k`` of ``owned_ranges`` and start, for each
        rank whose shard it overlaps, the sum of that part into that rank (async). Returns
        (work, finish): ``work.wait()`` then ``finish()`` puts this rank's part of the sum in
        gshard, or adds it there with ``accumulate`` (a later backward of the same step)."""
        lo, hi = self.owned_ranges()[k]
        S = self.layout.shard
        send = self.slots[slot][:hi - lo]
        self.fill_grads(send, lo)
        works, mine = [], None
        for r in range(lo // S, (hi - 1) // S + 1):
            a, b = max(lo, r * S), min(hi, (r + 1) * S)
            works.append(comm.reduce_async(send[a - lo:b - lo], r, group))
            if r == self.rank:
                mine = (send[a - lo:b - lo], a - r * S, b - r * S)

        def finish() -> None:
            if mine is not None:
                part, a, b = mine
                dst = self.gshard[a:b]
                if accumulate:
                    dst.add_(part.to(dst.device))
                else:
                    dst.copy_(part)
        return _AllWork(works), finish

    def _gather_source(self, a: int, b: int) -> torch.Tensor:
        """This rank's updated values of shard-local [a, b) in the param dtype."""
        src = self.lowp_shard if self.lowp else self.master
        if src is not None:
            return src[a:b]
        # fp32 params with the master swapped: this rank's piece of each param holds them
        part = torch.zeros(b - a, dtype=self.dtype, device=self.device)
        self.shard_values(a, b, part)
        return part

    def _scatter_gathered(self, out: torch.Tensor, a: int, n: int) -> None:
        """Every rank's [a, a + n) of its shard, gathered in ``out`` -> the params."""
        S = self.layout.shard
        for r in range(self.world):
            lo = r * S + a
            for pc in self.layout.pieces(lo, lo + n):
                p = self.params[pc.index].detach()
                chunk = out[r * n + pc.lo - lo:r * n + pc.hi - lo]
                if p.is_contiguous():
                    p.view(-1)[pc.param_offset:pc.param_offset + pc.numel].copy_(chunk)
                else:
                    flat = p.reshape(-1).clone()
                    flat[pc.param_offset:pc.param_offset + pc.numel].copy_(chunk)
                    p.copy_(flat.view_as(p))

    def all_gather_params(self, group: Any) -> None:
        """Every rank's updated shard -> every rank's params, bucket by bucket."""
        W = self.world
        for a, b in self.bucket_ranges():
            out = self.gather[:W * (b - a)]
            comm.all_gather(out, self._gather_source(a, b).to(out.device), group)
            self._scatter_gathered(out, a, b - a)

    def all_gather_bucket_async(self, a: int, b: int, slot: int, group: Any):
        """Start the all-gather of shard-local bucket [a, b) into gather slot 0 or 1; returns
        (handle, finish): ``handle.wait()`` then ``finish()`` writes the params. Slot 1 is
        the grad send buffer seen in the param dtype: free once the grads are reduced, so
        two buckets in flight cost no memory of their own."""
        n, W = b - a, self.world
        buf = self.gather if slot == 0 else self.send.view(self.dtype)
        out = buf[:W * n]
        work = comm.all_gather_async(out, self._gather_source(a, b).to(out.device), group)
        return work, lambda: self._scatter_gathered(out, a, n)

    def write_params(self, group: Any) -> None:
        """The params <- their masters (rounded to the param dtype), on every rank."""
        if self.world > 1:
            self.refresh_lowp_shard()
            self.all_gather_params(group)
            return
        if self.master is None:
            return  # bf16 master: the params (or the staging that mirrors them) are the master
        for i, p in enumerate(self.params):
            lo, hi = self.layout.slot(i)
            dst = p.detach()
            paging.will_write([dst])  # params on NVMe: bytes written past the pager are lost at the next load
            dst.copy_(self.master[lo:hi].view_as(p))
            paging.store([dst])
            paging.evict([dst])


class _AllWork:
    """``wait()`` for every handle of a bucket's collectives."""

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
