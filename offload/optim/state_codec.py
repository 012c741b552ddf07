"""Compressed optimizer states <-> torch's layout: the one conversion every store's
``state_dict()`` / ``load_state_dict()`` goes through.

A state stored as a ``StateField`` of ``state_dtype="bfloat16"`` (a bf16 tensor) or
``"int8"`` (packed 8-bit blocks, [Note: block-wise 8-bit states] in kernels/quant.py) leaves
the optimizer in torch's layout: a new float32 tensor of the param's shape, the stored
values decoded exactly (``to_torch_layout``), so a state_dict moves to ``torch.optim.AdamW``,
``SGD``, ``Adagrad`` or lion-pytorch's ``Lion`` and to an offload optimizer of any
``state_dtype``. Loading goes the other way (``from_torch_layout``): float32 values are
encoded as the field stores them, bf16 rounded to nearest even (one rounding of a loaded
value: nothing decays through it, so no stochastic rounding is needed), int8 block by block
as the kernels encode, except that a block whose decoded values some scale gives back exactly
keeps them ([Note: exact re-encoding] in kernels/quant.py). So both survive the round trip bit
for bit: an optimizer that loads another's state_dict goes on exactly as the other.

Every function returns a new tensor, never a view of its input: a compressed state in a
state_dict does not change when the optimizer steps later, and an optimizer does not share
its compressed states with the dict it loaded. (States kept as float32 in torch's layout,
the host store's, are shared with the dict both ways, as torch's optimizers share them: see
the README.)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from offload.kernels import quant
from offload.kernels.fields import StateField

__all__ = ["STOCHASTIC_BF16_STATES", "to_torch_layout", "from_torch_layout", "filled", "is_stored_form",
           "stored_nbytes"]

STOCHASTIC_BF16_STATES = True
"""bf16 states round stochastically in a step (every store passes this as the kernels'
``stochastic_states``). Rounded to nearest even, ``exp_avg_sq * 0.999`` rounds back to
itself (a bf16 step is 2**-8 relative, the decay 2**-10), so the second moment never decays:
after a grad of 1 and 2000 zero grads it stays at 1e-3 where float32 has 1.35e-4 (stochastic:
1.350e-4). On a small MLP (AdamW, 400 steps) the final loss is within 0.05 % of float32
stochastically, 0.2 % to nearest. Nearest is therefore not offered."""


def to_torch_layout(field: StateField, stored: torch.Tensor, numel: int,
                    shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``stored`` (``field``'s storage of ``numel`` values) as a new float32 tensor of
    ``shape`` (default: 1-D)."""
    if not is_stored_form(field, stored, numel):
        raise ValueError(f"state {field.name!r} ({field.describe()}) of {numel} elements is stored as "
                         f"{field.storage_numel(numel)} {field.storage_dtype} values, got "
                         f"{stored.numel()} {stored.dtype}")
    if field.blocked:
        values = quant.decode_blocks(stored.detach().reshape(-1), numel, field.signed, field.code)  # a new tensor
    else:
        values = stored.detach().reshape(-1).to(torch.float32, copy=True)
    return values.view(tuple(shape) if shape is not None else (numel,))


def from_torch_layout(field: StateField, values: torch.Tensor,
                      shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Floating-point ``values`` (torch's layout, any shape) encoded as ``field`` stores them:
    a new tensor, ``shape`` (default: ``values``' shape) for a per-element field, 1-D packed
    bytes for a blocked one."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"state {field.name!r}: expected a floating-point tensor, got "
                        f"{getattr(values, 'dtype', type(values).__name__)}")
    flat = values.detach().reshape(-1).to(torch.float32)
    if field.blocked:
        return quant.encode_blocks_exact(flat, field.signed, field.code)
    shape = tuple(values.shape) if shape is None else tuple(shape)
    if field.dtype == torch.bfloat16:
        return quant.round_bf16_nearest(flat).view(shape)  # quant's: the kernels' NaN bits
    return flat.to(field.dtype, copy=True).view(shape)


def filled(field: StateField, value: float, shape: Sequence[int]) -> torch.Tensor:
    """A new state of ``shape`` holding ``value`` everywhere, in ``field``'s storage form: the
    bits ``from_torch_layout`` gives a float32 tensor full of ``value``. Blocks and elements
    are encoded independently, so one unit (a block of a blocked field, an element of a
    per-element one) is encoded once and copied over the whole state; only a blocked field's
    last, partial block is encoded apart. Encoding the whole fill instead (even a few MiB at
    a time) churned ~50 B of temporaries per element: a param's first step took 35x its later
    steps with bf16 states and 20x with int8, and the freed temporaries left glibc's heap
    holding twice the states' bytes (RSS +184 MiB for 64 MiB of bf16 states at 16.8M)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    out = torch.empty(field.storage_numel(numel), dtype=field.storage_dtype)
    unit = quant.BLOCK if field.blocked else 1
    whole = numel // unit
    if whole:
        one = from_torch_layout(field, torch.full((unit,), value, dtype=torch.float32)).reshape(-1)
        out[:whole * one.numel()].view(whole, one.numel()).copy_(one.expand(whole, one.numel()))
    if whole * unit < numel:  # a blocked field's last, partial block
        tail = from_torch_layout(field, torch.full((numel - whole * unit,), value, dtype=torch.float32))
        out[whole * quant.PACKED_BLOCK:] = tail.reshape(-1)
    return out if field.blocked else out.view(tuple(shape))


def is_stored_form(field: StateField, t: object, numel: int) -> bool:
    """Whether ``t`` is a tensor in ``field``'s storage form for ``numel`` values."""
    return (isinstance(t, torch.Tensor) and t.dtype == field.storage_dtype
            and t.numel() == field.storage_numel(numel))


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes a stored state tensor takes (what memory reports count)."""
    return t.numel() * t.element_size()
