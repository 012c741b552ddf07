"""Element ranges of compressed states inside a swap buffer (the swapped store's views).

A sub-group's state in a pipeline buffer is its field's storage: float32 or bfloat16
elements, or packed 8-bit blocks ([Note: block-wise 8-bit states] in kernels/quant.py) whose
bytes cannot be sliced by element. Here the swapped store finds the storage of an element
range (a kernel call needs whole blocks: it starts on a block boundary), and reads or
writes float32 values of any range (state_dict, load_state_dict, the fp32 checkpoint path):
a range that cuts a block decodes the whole block, and a write re-encodes it (the other
values of that block are re-quantized with the block's new absmax: writes land on whole
params, so this only touches the neighbours of a param that shares a block with them, in
the flat store's layout).

[Note: rounding in the swapped store] With compressed states (bf16, packed int8 blocks) or a
bf16 param that is its own master, each kernel call rounds stochastically from a seed and
the index of its first element ([Note: stochastic rounding to bfloat16] in kernels/quant.py).
A work item may bring ``rounding_seed`` and ``element_offset`` (of its first element) in its
kwargs (the stores that know which element space the bits must not depend on: the flat
store's whole flat group, SwappedState's param); else the seed is
``quant.rounding_seed(step, shard index)`` and the offset the item's in its shard. A
sub-group that cuts an item steps its part with the offset moved by as much, so the bits do
not depend on the sub-group size or on max_host_bytes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.kernels.compressed_ref import decode_state, encode_state
from offload.kernels.fields import StateField
from offload.kernels.quant import BLOCK, rounding_seed
from offload.memory import paging

__all__ = ["page_in", "page_out", "paged_copy", "storage_slice", "read_values", "read_dtype", "write_values", "compressed", "DecodedBlocks", "whole_blocks",
           "rounding_kwargs"]


def compressed(field: StateField) -> bool:
    """Whether ``field`` is stored in another form than float32 (bf16, packed blocks)."""
    return field.blocked or field.dtype != torch.float32


def storage_slice(field: StateField, t: torch.Tensor, x0: int, x1: int) -> torch.Tensor:
    """The storage of elements [x0, x1) of ``t`` (one sub-group's state, storage dtype); a
    blocked field needs ``x0`` on a block boundary (ValueError otherwise: the kernel would
    re-encode a block from part of its values)."""
    off = field.storage_offset(x0)
    return t[off:off + field.storage_numel(x1 - x0)]


def _block_span(x0: int, x1: int, n: int) -> Tuple[int, int]:
    """The whole blocks of a sub-group of ``n`` elements that hold [x0, x1)."""
    return x0 // BLOCK * BLOCK, min(-(-x1 // BLOCK) * BLOCK, n)


def read_values(field: StateField, t: torch.Tensor, x0: int, x1: int, n: int, stored: bool = False) -> torch.Tensor:
    """New float32 values of elements [x0, x1) of ``t`` (a sub-group of ``n`` elements);
    ``stored``: a per-element field's values as stored (bf16 as bf16: ``opt.state[p]``, as
    the RAM stores give it), blocks decoded all the same (``read_dtype``)."""
    if not field.blocked:
        return t[x0:x1] if stored else t[x0:x1].float()  # float32's slice, or a stored one, is copied by the caller
    a, b = _block_span(x0, x1, n)
    return decode_state(field, storage_slice(field, t, a, b), b - a)[x0 - a:x1 - a]


def read_dtype(field: StateField, stored: bool) -> torch.dtype:
    """The dtype ``read_values`` gives for ``field``."""
    return field.dtype if stored and not field.blocked else torch.float32 if compressed(field) else field.dtype


def write_values(field: StateField, t: torch.Tensor, x0: int, x1: int, n: int, values: torch.Tensor) -> None:
    """Store float32 ``values`` as elements [x0, x1) of ``t`` (a sub-group of ``n``
    elements): bf16 rounded to nearest, blocks re-encoded whole."""
    values = values.detach().reshape(-1).float()
    if not field.blocked:
        t[x0:x1].copy_(values)  # copy_ rounds to nearest even
        return
    a, b = _block_span(x0, x1, n)
    dst = storage_slice(field, t, a, b)
    whole = decode_state(field, dst, b - a)
    whole[x0 - a:x1 - a] = values
    encode_state(field, whole, dst, stochastic=False, seed=0, offset=0, stream=0, exact=True)


class DecodedBlocks:
    """[Note: steps across blocks] A kernel call re-encodes whole blocks, so it must start on
    a block and end on one, at the sub-group's end or at its shard's end (the padding after).
    When a sub-group's ranges do not (the flat store's per-param pieces: params share
    blocks), its blocked states are decoded to float32 here, every range steps with the
    float32 rule in place, and the blocks the ranges touched are encoded back once: the
    scheme's decode -> step -> encode (compressed_ref.compose_step) per block, as the fused
    kernel does on whole blocks; the blocks no range touched keep their bytes. Values of a
    block's other elements are re-quantized with it (the block's new absmax)."""

    def __init__(self, fields, tensors, n: int) -> None:
        self.fields, self.packed, self.n = fields, tensors, n
        self.values = {k: decode_state(f, tensors[k], n) for k, f in fields.items()}
        self.touched = torch.zeros(-(-n // BLOCK), dtype=torch.bool)

    def view(self, k: int, x0: int, x1: int) -> torch.Tensor:
        self.touched[x0 // BLOCK:-(-x1 // BLOCK)] = True
        return self.values[k][x0:x1]

    def store(self) -> None:
        for k, f in self.fields.items():
            new = torch.empty_like(self.packed[k])
            encode_state(f, self.values[k], new, stochastic=False, seed=0, offset=0, stream=0)
            rows = self.packed[k].view(-1, f.storage_numel(BLOCK))
            rows[self.touched] = new.view(-1, f.storage_numel(BLOCK))[self.touched]


def whole_blocks(x0: int, x1: int, n: int, live_end: bool) -> bool:
    """Whether a kernel call may step [x0, x1) of a sub-group of ``n`` elements on its own:
    it starts on a block and ends on one, at ``n``, or where only padding follows (``live_end``)."""
    return x0 % BLOCK == 0 and (x1 % BLOCK == 0 or x1 == n or live_end)


def rounding_kwargs(kw: Dict[str, Any], shard: int, at: int, skip: int, stochastic: bool) -> Dict[str, Any]:
    """``kw`` with the rounding streams of a range that starts ``skip`` elements into its work
    item, at element ``at`` of shard ``shard`` (the note above)."""
    kw = dict(kw)
    seed = kw.pop("rounding_seed", None)
    offset = kw.pop("element_offset", None)
    kw["rounding_seed"] = rounding_seed(kw["step"], shard) if seed is None else seed
    kw["element_offset"] = at if offset is None else offset + skip
    kw.setdefault("stochastic_states", stochastic)
    return kw


def page_in(by_group: Dict[int, Any], g: int) -> Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]]:
    """Params on NVMe ([Note: paged tensors] in offload/memory/paging.py): the grads and
    outputs of a sub-group's ranges brought in (the next sub-group's grads asked for, to
    read meanwhile); (outputs, grads) to store and evict after the kernel, or None."""
    if not paging.active():
        return None

    def views(rows):
        outs, grads, masters = [], [], []
        for a, b, start, it in rows:
            y = slice(a - start, b - start)
            grads.append(it.grad[y])
            if it.out is not None:
                (masters if it.mode == "master" else outs).append(it.out[y])
        return outs, grads, masters

    outs, grads, masters = views(by_group[g])
    if not any(paging.paged(t) for t in outs + grads + masters):
        return None
    paging.load(grads + masters)
    paging.will_write(outs)
    following = min((k for k in by_group if k > g), default=None)
    if following is not None:
        nxt = views(by_group[following])
        paging.prefetch(nxt[1] + nxt[2])
    return outs + masters, grads


def page_out(touched: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]]) -> None:
    """After the kernel: what ``page_in`` brought in, outputs to disk, all out of RAM."""
    if touched:
        outs, grads = touched
        paging.store(outs)
        paging.evict(grads + outs)


def paged_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where ``dst`` may be paged (params on NVMe)."""
    paging.will_write([dst])
    dst.copy_(src)
    paging.store([dst])
    paging.evict([dst])
