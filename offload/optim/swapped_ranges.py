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
"""
from __future__ import annotations

from typing import Tuple

import torch

from offload.kernels.compressed_ref import decode_state, encode_state
from offload.kernels.fields import StateField
from offload.kernels.quant import BLOCK

__all__ = ["storage_slice", "read_values", "write_values", "compressed"]


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


def read_values(field: StateField, t: torch.Tensor, x0: int, x1: int, n: int) -> torch.Tensor:
    """New float32 values of elements [x0, x1) of ``t`` (a sub-group of ``n`` elements)."""
    if not field.blocked:
        return t[x0:x1].float()  # a copy for bf16; float32's slice is copied by the caller
    a, b = _block_span(x0, x1, n)
    return decode_state(field, storage_slice(field, t, a, b), b - a)[x0 - a:x1 - a]


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
    encode_state(field, whole, dst, stochastic=False, seed=0, offset=0, stream=0)
